-- Accept one outer-gradient update into the open round of its fragment, exactly once.
-- KEYS: frag, pend, pmeta, contrib, seen, stats
-- ARGV: uid, learner, seq, base_version, max_staleness, payload, meta_json
if redis.call('SISMEMBER', KEYS[5], ARGV[3]) == 1 then
  return {'duplicate', tonumber(redis.call('HGET', KEYS[1], 'version') or '0'), 0}
end
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return {'uninitialized', 0, 0} end
v = tonumber(v)
local base = tonumber(ARGV[4])
if base > v then return {'future', v, 0} end
if v - base > tonumber(ARGV[5]) then return {'stale', v, 0} end
redis.call('SADD', KEYS[5], ARGV[3])
redis.call('EXPIRE', KEYS[5], 604800)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[6])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[7])
redis.call('SADD', KEYS[4], ARGV[2])
redis.call('HINCRBY', KEYS[6], 'updates_accepted', 1)
return {'accepted', v, redis.call('SCARD', KEYS[4])}
