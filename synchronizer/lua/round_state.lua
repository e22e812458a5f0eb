-- Read one fragment's open round and the live learners, at one instant of Redis time.
-- KEYS: round, contrib, learners, ema, stats, finished, finishing
-- ARGV: fragment
-- Returns: now_ms, opened_ms, quorum_ms, deadline_ms, contributors, live, slowest_ema, t_sync,
--          finished (live learners that have sent their last update),
--          waiting (live learners that may still send an update to this round: not in it yet,
--          not finished, and not finishing without this fragment still to send)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', KEYS[1], 'opened_ms', 'quorum_ms', 'deadline_ms')
local live = redis.call('ZRANGEBYSCORE', KEYS[3], now, '+inf')
local slowest = 0
if #live > 0 then
  for _, e in ipairs(redis.call('HMGET', KEYS[4], unpack(live))) do
    if e and tonumber(e) > slowest then slowest = tonumber(e) end
  end
end
local t_sync = redis.call('HGET', KEYS[5], 't_sync_ema') or '0'
local finished, waiting = 0, 0
local mark = ',' .. ARGV[1] .. ','
for _, id in ipairs(live) do
  if redis.call('SISMEMBER', KEYS[6], id) == 1 then
    finished = finished + 1
  elseif redis.call('SISMEMBER', KEYS[2], id) == 0 then
    local still = redis.call('HGET', KEYS[7], id)
    if not still or string.find(still, mark, 1, true) then waiting = waiting + 1 end
  end
end
return {now, r[1] or tostring(now), r[2] or '', r[3] or '', redis.call('SCARD', KEYS[2]), #live,
  tostring(slowest), t_sync, finished, waiting}
