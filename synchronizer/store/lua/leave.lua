-- A learner's session ended cleanly: drop its lease if it is still this incarnation's.
-- KEYS: learners, learner   ARGV: id, incarnation
if redis.call('HGET', KEYS[2], 'incarnation') ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
