-- Record one update summed into its fragment's open round, exactly once per owner epoch.
-- The owner has added the update to its accumulator already; on any status but 'received'
-- it takes it out again.
-- KEYS: frag, owner, round, seen, stats
-- ARGV: replica, epoch, uid, seq, checksum, base_version, max_staleness, record_json
-- Returns: {status, version}: received | duplicate (committed already) | again (received
--   under this epoch already) | checksum (a retry with other bytes) | not_owner |
--   uninitialized | future | stale
local v = redis.call('HGET', KEYS[1], 'version')
if redis.call('GET', KEYS[2]) ~= ARGV[1] .. ' ' .. ARGV[2] then
  return {'not_owner', tonumber(v or '0')}
end
if not v then return {'uninitialized', 0} end
v = tonumber(v)
local seen = redis.call('HGET', KEYS[4], ARGV[4])
if seen then
  local epoch, sum, state = string.match(seen, '^(%d+) (%S+) (%a)$')
  if sum ~= ARGV[5] then return {'checksum', v} end
  if state == 'c' then return {'duplicate', v} end
  if epoch == ARGV[2] then return {'again', v} end
end
local base = tonumber(ARGV[6])
if base > v then return {'future', v} end
if v - base > tonumber(ARGV[7]) then return {'stale', v} end
if not seen then redis.call('HINCRBY', KEYS[5], 'updates_accepted', 1) end
redis.call('HSET', KEYS[4], ARGV[4], ARGV[2] .. ' ' .. ARGV[5] .. ' r')
redis.call('EXPIRE', KEYS[4], 604800)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[8])
return {'received', v}
