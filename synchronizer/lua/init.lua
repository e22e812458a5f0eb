-- Set the job's initial parameters once (set-if-absent over the whole model).
-- KEYS: init, frag_1..frag_P, round_1..round_P   ARGV: P, theta_1..theta_P, opt_1..opt_P
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local p = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, p do
  redis.call('HSET', KEYS[1 + i], 'theta', ARGV[1 + i], 'opt', ARGV[1 + p + i], 'version', 0,
    'committed_ms', now)
  redis.call('HSET', KEYS[1 + p + i], 'opened_ms', now)
end
redis.call('SET', KEYS[1], now)
return 1
