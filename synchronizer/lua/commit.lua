-- Commit one merged round: only under the caller's merge lease (fencing token) and only
-- onto the version the merge was computed from, so each round commits exactly once. The new
-- value and optimizer state were staged under their own keys; they are renamed into place.
-- The encoded delta to the new version is kept for a while, for learners that missed it.
-- KEYS: frag, pmeta, contrib, round, lease, log, stats, theta, opt, stage_theta, stage_opt,
--       stage_delta, delta, payload_1..payload_n
-- ARGV: token, expected_version, n, uid_1..uid_n,
--       useful_seconds, tokens_merged, stale_folded, t_sync_sample, log_entry, channel, fragment,
--       delta_ttl_s
local function abort(status, v)
  redis.call('DEL', KEYS[10], KEYS[11], KEYS[12])
  return {status, v}
end
if redis.call('GET', KEYS[5]) ~= ARGV[1] then return abort('lost_lease', 0) end
local v = tonumber(redis.call('HGET', KEYS[1], 'version'))
if v ~= tonumber(ARGV[2]) then return abort('version_moved', v) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
v = v + 1
redis.call('RENAME', KEYS[10], KEYS[8])
redis.call('RENAME', KEYS[11], KEYS[9])
redis.call('RENAME', KEYS[12], KEYS[13])
redis.call('EXPIRE', KEYS[13], tonumber(ARGV[3 + tonumber(ARGV[3]) + 8]))
redis.call('HSET', KEYS[1], 'version', v, 'committed_ms', now)
local n = tonumber(ARGV[3])
for i = 1, n do
  redis.call('HDEL', KEYS[2], ARGV[3 + i])
  redis.call('DEL', KEYS[13 + i])
end
-- Updates not taken into this round stay pending: they are folded into the next one.
redis.call('DEL', KEYS[3])
for _, meta in ipairs(redis.call('HVALS', KEYS[2])) do
  redis.call('SADD', KEYS[3], cjson.decode(meta)['learner'])
end
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'opened_ms', now)
local o = 3 + n
redis.call('HINCRBYFLOAT', KEYS[7], 'useful_seconds', ARGV[o + 1])
redis.call('HINCRBYFLOAT', KEYS[7], 'tokens_merged', ARGV[o + 2])
redis.call('HINCRBY', KEYS[7], 'stale_folded', ARGV[o + 3])
redis.call('HINCRBY', KEYS[7], 'versions_committed', 1)
local sample = tonumber(ARGV[o + 4])
local ema = tonumber(redis.call('HGET', KEYS[7], 't_sync_ema') or ARGV[o + 4])
redis.call('HSET', KEYS[7], 't_sync_ema', tostring(0.8 * ema + 0.2 * sample))
redis.call('RPUSH', KEYS[6], ARGV[o + 5])
redis.call('DEL', KEYS[5])
redis.call('PUBLISH', ARGV[o + 6], cjson.encode({fragment = tonumber(ARGV[o + 7]), version = v}))
return {'committed', v}
