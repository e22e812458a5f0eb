-- Renew a learner's lease, unless a newer incarnation of the same id has taken it over, or
-- the same incarnation opened a newer session (it reconnected: `hello.lua`).
-- Returns the inner steps of all learner slots together (each slot's steps as counted: its
-- claim, bounded by the session's step rate, see admission.counted_steps), or -1 when the
-- lease was not renewed (a newer incarnation), -2 (a newer session of this incarnation).
-- KEYS: learners, learner, ema, slot_steps, finished, finishing
-- ARGV: id, incarnation, ttl_ms, step, ema_s, tokens_s, loss, eval, done, last_sent,
--       still_to_send (',1,3,': finishing with those fragments still to send; '': not),
--       counted (the slot's steps toward the budget, an integer), session
-- `finished` holds the learners that sent their last update (rounds stop waiting for them);
-- `finishing` the ones that stopped stepping, with the fragments they will still send (rounds
-- of other fragments stop waiting for them); the learner's `done` says it also finished its
-- final sync (the run's end waits for that).
if redis.call('HGET', KEYS[2], 'incarnation') ~= ARGV[2] then return -1 end
if redis.call('HGET', KEYS[2], 'joins') ~= ARGV[13] then return -2 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[2], 'updated_ms', now, 'step', ARGV[4], 'step_time_ema_s', ARGV[5],
  'tokens_per_s', ARGV[6], 'loss', ARGV[7], 'eval_loss', ARGV[8], 'done', ARGV[9])
if tonumber(ARGV[5]) > 0 then redis.call('HSET', KEYS[3], ARGV[1], ARGV[5]) end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[12])
if ARGV[10] == '1' then redis.call('SADD', KEYS[5], ARGV[1]) else redis.call('SREM', KEYS[5], ARGV[1]) end
if ARGV[11] ~= '' then redis.call('HSET', KEYS[6], ARGV[1], ARGV[11]) else redis.call('HDEL', KEYS[6], ARGV[1]) end
local total = 0
for _, steps in ipairs(redis.call('HVALS', KEYS[4])) do total = total + tonumber(steps) end
return total
