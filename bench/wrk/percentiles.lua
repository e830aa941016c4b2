-- wrk reporter: requests/s and the p50/p95/p99 latency in milliseconds, one line.
-- The Authorization header comes from the STOCKD_BENCH_TOKEN environment variable.
local token = os.getenv("STOCKD_BENCH_TOKEN")
wrk.headers["Authorization"] = "Bearer " .. (token or "")

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
