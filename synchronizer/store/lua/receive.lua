-- Record one update summed into its fragment's open round, exactly once per owner epoch.
-- The owner has added the update to its accumulator already; on any status but 'received'
-- it takes it out again.
-- `seen` holds one learner slot's idempotency records on this fragment (seq -> 'epoch
-- checksum state'), of one incarnation: the slot's newest to send here, with the generation
-- of its hello (the slot's count of hellos). A newer incarnation's first update replaces
-- them, so a slot has one such record set per fragment however often it restarts; an older
-- incarnation is refused from then on, so no retry of its committed updates can find its
-- records gone and be applied again. The caller passes the generation only after reading
-- that this incarnation is the slot's current one; '' asks first.
-- Of the replaced records of updates received but not committed, those whose round died
-- with an earlier owner are counted in the stats' `updates_dropped`; those of this epoch's
-- rounds are kept in `orphans` until their round commits (`commit.lua`) or dies with this
-- owner (`own.lua` counts them then): nobody is left to send them again.
-- A received update's norm as it merges (clipped) becomes its slot's entry in `norms`, the
-- history the fragment's next updates are bounded by, whoever owns it next.
-- KEYS: frag, owner, round, seen, stats, orphans, norms
-- ARGV: replica, epoch, uid, seq, checksum, base_version, max_staleness, record_json,
--       incarnation, generation ('': not looked up; 0: the slot never said hello), ttl_s,
--       learner (the slot), 'norm steps' ('': none)
-- Returns: {status, version}: received | duplicate (committed already) | again (received
--   under this epoch already) | checksum (a retry with other bytes) | not_owner |
--   uninitialized | future | stale (not for a resend of an update received under an earlier
--   epoch) | new_incarnation (look the slot's incarnation up) |
--   superseded (a newer incarnation of the slot sends here)
local v = redis.call('HGET', KEYS[1], 'version')
if redis.call('GET', KEYS[2]) ~= ARGV[1] .. ' ' .. ARGV[2] then
  return {'not_owner', tonumber(v or '0')}
end
if not v then return {'uninitialized', 0} end
v = tonumber(v)
local holder = redis.call('HGET', KEYS[4], 'incarnation')
if holder ~= ARGV[9] then
  if ARGV[10] == '' then return {'new_incarnation', v} end
  local generation = tonumber(ARGV[10])
  local held = tonumber(redis.call('HGET', KEYS[4], 'generation') or '-1')
  -- A slot that never said hello (generation 0) has no order to keep: its newest replaces.
  if holder and generation <= held and generation > 0 then return {'superseded', v} end
  -- The older incarnation's updates received under an earlier epoch died with their round,
  -- and it can no longer send them again: counted (`atoll up`'s report), then let go.
  if holder then
    local dropped = 0
    local records = redis.call('HGETALL', KEYS[4])
    for i = 1, #records, 2 do
      local epoch, state = string.match(records[i + 1], '^(%d+) %S+ (%a)$')
      if state == 'r' and tonumber(epoch) < tonumber(ARGV[2]) then
        dropped = dropped + 1
      elseif state == 'r' then
        redis.call('SADD', KEYS[6], ARGV[12] .. '/' .. holder .. '/' .. records[i])
      end
    end
    if dropped > 0 then redis.call('HINCRBY', KEYS[5], 'updates_dropped', dropped) end
  end
  redis.call('DEL', KEYS[4])
  redis.call('HSET', KEYS[4], 'incarnation', ARGV[9], 'generation', ARGV[10])
end
local seen = redis.call('HGET', KEYS[4], ARGV[4])
if seen then
  local epoch, sum, state = string.match(seen, '^(%d+) (%S+) (%a)$')
  if sum ~= ARGV[5] then return {'checksum', v} end
  if state == 'c' then return {'duplicate', v} end
  if epoch == ARGV[2] then return {'again', v} end
end
local base = tonumber(ARGV[6])
if base > v then return {'future', v} end
-- A resend of an update received under an earlier epoch (its round died with that owner)
-- was admitted once: it merges now however far the fragment moved meanwhile.
if not seen and v - base > tonumber(ARGV[7]) then return {'stale', v} end
if not seen then redis.call('HINCRBY', KEYS[5], 'updates_accepted', 1) end
redis.call('HSET', KEYS[4], ARGV[4], ARGV[2] .. ' ' .. ARGV[5] .. ' r')
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[11]))
redis.call('HSET', KEYS[3], ARGV[3], ARGV[8])
if ARGV[13] ~= '' then
  redis.call('HSET', KEYS[7], ARGV[12], ARGV[13])
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[11]))
end
return {'received', v}
