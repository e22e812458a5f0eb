-- A learner (re)joins: the first learner's parameter spec becomes the job's; later ones must
-- match it. A slot has at most one live session: while its lease runs (its session is open
-- somewhere, or ended without saying so less than a lease ago), a hello of another
-- incarnation is refused. The same incarnation's hello is that process reconnecting (its
-- replica died, its stream broke): it opens a new session, numbered by the slot's count of
-- hellos, and the old one's heartbeats and leave no longer count (`heartbeat.lua`). While the job has no parameters, one learner at a time holds the
-- claim to send them (for claim_ms), so the others wait for them instead of all uploading the
-- whole model. The slot's steps toward the job's budget restart from its hello's step, or
-- stay where they were counted if that is lower (a restored learner's earlier checkpoint
-- lowers them; a claim above what was counted only catches up as its heartbeats go on).
-- A pool's credential (one certificate for every slot starting with a prefix) opens at
-- most pool_size sessions at once: a hello is refused while that many other slots of the
-- prefix hold live leases.
-- KEYS: spec, learners, learner, ema, init_claim, slot_steps
-- ARGV: spec_json, id, incarnation, ttl_ms, step, claim_ms, initialized (1/0),
--       pool prefix ('': not a pool's credential), pool_size (0: no cap)
-- Returns: status ('ok' | 'spec_mismatch' | 'busy' | 'pool_full'), previous incarnation,
--          holds the claim, the slot's steps counted now, the job's steps over all slots,
--          the session (the slot's count of hellos)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local previous = redis.call('HGET', KEYS[3], 'incarnation') or ''
local lease = redis.call('ZSCORE', KEYS[2], ARGV[2])
if lease and tonumber(lease) > now and previous ~= ARGV[3] then return {'busy', previous, 0, 0} end
local cap = tonumber(ARGV[9] or '0')
if ARGV[8] and ARGV[8] ~= '' and cap > 0 then
  local held = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], now + 1, '+inf')) do
    if id ~= ARGV[2] and string.sub(id, 1, #ARGV[8]) == ARGV[8] then held = held + 1 end
  end
  if held >= cap then return {'pool_full', previous, 0, 0} end
end
local stored = redis.call('GET', KEYS[1])
if not stored then
  redis.call('SET', KEYS[1], ARGV[1])
  stored = ARGV[1]
end
if stored ~= ARGV[1] then return {'spec_mismatch', stored, 0, 0} end
redis.call('HSET', KEYS[3], 'incarnation', ARGV[3], 'joined_ms', now, 'updated_ms', now,
  'step', ARGV[5])
local session = redis.call('HINCRBY', KEYS[3], 'joins', 1)
redis.call('HDEL', KEYS[4], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[2])
local counted = math.min(tonumber(ARGV[5]), tonumber(redis.call('HGET', KEYS[6], ARGV[2]) or '0'))
redis.call('HSET', KEYS[6], ARGV[2], string.format('%d', counted))
local claimed = 0
if ARGV[7] == '0' then
  redis.call('SET', KEYS[5], ARGV[2], 'NX', 'PX', tonumber(ARGV[6]))
  if redis.call('GET', KEYS[5]) == ARGV[2] then claimed = 1 end
end
local total = 0
for _, steps in ipairs(redis.call('HVALS', KEYS[6])) do total = total + tonumber(steps) end
return {'ok', previous, claimed, string.format('%d', counted), string.format('%d', total), session}
