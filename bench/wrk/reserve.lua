-- wrk request generator: POST /v1/reservations of one unit of $STOCKD_BENCH_SKU, each
-- request under an idempotency key of its own (thread and counter) and, with
-- $STOCKD_BENCH_USERS set, for one of that many shoppers. Reports as percentiles.lua.
local token = os.getenv("STOCKD_BENCH_TOKEN") or ""
local sku = os.getenv("STOCKD_BENCH_SKU") or "hot"
local users = tonumber(os.getenv("STOCKD_BENCH_USERS") or "0")
local run = os.getenv("STOCKD_BENCH_RUN") or "run"
local counter = 0
local thread_number = 0
local threads = {}

function setup(thread)
    thread_number = thread_number + 1
    thread:set("thread_number", thread_number)
    table.insert(threads, thread)
end

function request()
    counter = counter + 1
    local key = string.format("%s-%d-%d", run, thread_number, counter)
    local body
    if users > 0 then
        local user = (counter * 7919 + thread_number * 104729) % users
        body = string.format('{"lines":[{"sku":"%s","quantity":1}],"user_id":"user-%d"}', sku, user)
    else
        body = string.format('{"lines":[{"sku":"%s","quantity":1}]}', sku)
    end
    return wrk.format("POST", "/v1/reservations", {
        ["Authorization"] = "Bearer " .. token,
        ["Content-Type"] = "application/json",
        ["Idempotency-Key"] = key,
    }, body)
end

done = function(summary, latency, requests)
    local seconds = summary.duration / 1e6
    io.write(string.format(
        "requests_per_second=%.0f p50_ms=%.2f p95_ms=%.2f p99_ms=%.2f errors=%d non_2xx=%d\n",
        summary.requests / seconds,
        latency:percentile(50) / 1000, latency:percentile(95) / 1000,
        latency:percentile(99) / 1000,
        summary.errors.connect + summary.errors.read + summary.errors.write
            + summary.errors.timeout,
        summary.errors.status))
end
