-- Commit one merged round: only under the caller's merge lease (fencing token) and only
-- onto the version the merge was computed from, so each round commits exactly once.
-- KEYS: frag, pend, pmeta, contrib, round, lease, log, stats
-- ARGV: token, expected_version, theta, opt, n, uid_1..uid_n,
--       useful_seconds, tokens_merged, stale_folded, t_sync_sample, log_entry, channel, fragment
if redis.call('GET', KEYS[6]) ~= ARGV[1] then return {'lost_lease', 0} end
local v = tonumber(redis.call('HGET', KEYS[1], 'version'))
if v ~= tonumber(ARGV[2]) then return {'version_moved', v} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
v = v + 1
redis.call('HSET', KEYS[1], 'theta', ARGV[3], 'opt', ARGV[4], 'version', v, 'committed_ms', now)
local n = tonumber(ARGV[5])
for i = 1, n do
  redis.call('HDEL', KEYS[2], ARGV[5 + i])
  redis.call('HDEL', KEYS[3], ARGV[5 + i])
end
-- Updates that arrived during the merge stay pending: they are folded into the next round.
redis.call('DEL', KEYS[4])
for _, meta in ipairs(redis.call('HVALS', KEYS[3])) do
  redis.call('SADD', KEYS[4], cjson.decode(meta)['learner'])
end
redis.call('DEL', KEYS[5])
redis.call('HSET', KEYS[5], 'opened_ms', now)
local o = 5 + n
redis.call('HINCRBYFLOAT', KEYS[8], 'useful_seconds', ARGV[o + 1])
redis.call('HINCRBYFLOAT', KEYS[8], 'tokens_merged', ARGV[o + 2])
redis.call('HINCRBY', KEYS[8], 'stale_folded', ARGV[o + 3])
redis.call('HINCRBY', KEYS[8], 'versions_committed', 1)
local sample = tonumber(ARGV[o + 4])
local ema = tonumber(redis.call('HGET', KEYS[8], 't_sync_ema') or ARGV[o + 4])
redis.call('HSET', KEYS[8], 't_sync_ema', tostring(0.8 * ema + 0.2 * sample))
redis.call('RPUSH', KEYS[7], ARGV[o + 5])
redis.call('DEL', KEYS[6])
redis.call('PUBLISH', ARGV[o + 6], cjson.encode({fragment = tonumber(ARGV[o + 7]), version = v}))
return {'committed', v}
