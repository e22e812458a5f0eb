-- Accept one outer-gradient update into the open round of its fragment, exactly once.
-- The payload was written just before, under its own key with an expiry; this script makes
-- it permanent if the update is accepted and deletes it otherwise. (Payloads stay out of
-- script arguments: Lua copies every argument, which costs more than the write itself.)
-- KEYS: frag, pmeta, contrib, seen, stats, payload
-- ARGV: uid, learner, seq, base_version, max_staleness, meta_json
local function refuse(status, v)
  redis.call('DEL', KEYS[6])
  return {status, v, 0}
end
local v = redis.call('HGET', KEYS[1], 'version')
if redis.call('SISMEMBER', KEYS[4], ARGV[3]) == 1 then
  -- A retry (after a reconnect, perhaps to another replica). Its payload was just written
  -- over the original's key: if the original is still pending, that key is its payload (the
  -- same bytes) and must stay; only an already merged one's is dropped.
  if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
    redis.call('PERSIST', KEYS[6])
    return {'duplicate', tonumber(v or '0'), 0}
  end
  return refuse('duplicate', tonumber(v or '0'))
end
if not v then return refuse('uninitialized', 0) end
v = tonumber(v)
local base = tonumber(ARGV[4])
if base > v then return refuse('future', v) end
if v - base > tonumber(ARGV[5]) then return refuse('stale', v) end
if redis.call('EXISTS', KEYS[6]) == 0 then return {'payload_missing', v, 0} end
redis.call('PERSIST', KEYS[6])
redis.call('SADD', KEYS[4], ARGV[3])
redis.call('EXPIRE', KEYS[4], 604800)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[6])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[5], 'updates_accepted', 1)
return {'accepted', v, redis.call('SCARD', KEYS[3])}
