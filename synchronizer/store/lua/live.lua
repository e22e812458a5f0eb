-- The job's live learners at one instant of Redis time, for the round rule to decide on.
-- KEYS: learners, ema, finished, finishing
-- Returns: now_ms, then per live learner: id, step-time EMA ('' if none), finished (1/0),
--          fragments it still sends while finishing (',1,3,'; '' when not finishing)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
  out[#out + 1] = redis.call('SISMEMBER', KEYS[3], id)
  local still = redis.call('HGET', KEYS[4], id)
  out[#out + 1] = still or ''
end
return out
