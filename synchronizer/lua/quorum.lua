-- Record that a round reached quorum, and when its grace window ends (first caller wins).
-- KEYS: round   ARGV: grace_ms
if redis.call('HEXISTS', KEYS[1], 'quorum_ms') == 1 then
  return redis.call('HMGET', KEYS[1], 'quorum_ms', 'deadline_ms')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'quorum_ms', now, 'deadline_ms', deadline)
return {tostring(now), tostring(deadline)}
