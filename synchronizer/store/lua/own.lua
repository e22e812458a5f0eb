-- Take, keep or give back the ownership of one fragment (a lease with a fencing epoch).
-- KEYS: owner, epoch, round, orphans, stats
-- ARGV: op ('acquire' | 'renew' | 'release'), replica, epoch (renew/release), ttl_ms
-- acquire: if no one owns it, the epoch grows and the caller owns it; the open round's
--   records of earlier epochs are void (their accumulator died with their owner), and those
--   of them whose slot's records a newer incarnation replaced (`orphans`, `receive.lua`)
--   are counted as dropped with their sender: nobody is left to send them again.
-- Returns: {status, epoch}: status 'owned' | 'taken' (someone else owns it) | 'lost'
local held = redis.call('GET', KEYS[1])
if ARGV[1] == 'acquire' then
  if held then return {'taken', tonumber(string.match(held, ' (%d+)$'))} end
  local e = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[2] .. ' ' .. e, 'PX', tonumber(ARGV[4]))
  redis.call('DEL', KEYS[3])
  local orphans = redis.call('SCARD', KEYS[4])
  if orphans > 0 then
    redis.call('HINCRBY', KEYS[5], 'updates_dropped', orphans)
    redis.call('DEL', KEYS[4])
  end
  return {'owned', e}
end
local mine = ARGV[2] .. ' ' .. ARGV[3]
if held ~= mine then return {'lost', 0} end
if ARGV[1] == 'renew' then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
else
  redis.call('DEL', KEYS[1])
end
return {'owned', tonumber(ARGV[3])}
