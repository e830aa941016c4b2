-- wrk request generator: POST /v1/reservations of one unit of $STOCKD_BENCH_SKU, each
-- request under an idempotency key of its own (thread and counter) and, with
-- $STOCKD_BENCH_USERS set, for one of that many shoppers. Reports as percentiles.lua.
local token = os.getenv("STOCKD_BENCH_TOKEN") or ""
local sku = os.getenv("STOCKD_BENCH_SKU") or "hot"
local users = tonumber(os.getenv("STOCKD_BENCH_USERS") or "0")
local run = os.getenv("STOCKD_BENCH_RUN") or "run"
local counter = 0
local thread_number = 0

function setup(thread)
    thread_number = thread_number + 1
    thread:set("thread_number", thread_number)
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

-- The same one-line report as percentiles.lua (its header is replaced per request).
dofile("bench/wrk/percentiles.lua")
