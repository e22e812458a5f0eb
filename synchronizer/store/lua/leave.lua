-- A learner's session ended cleanly: drop its lease if it is still this session's (the
-- incarnation's, and no newer session of it opened since: `hello.lua`).
-- KEYS: learners, learner   ARGV: id, incarnation, session
if redis.call('HGET', KEYS[2], 'incarnation') ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[2], 'joins') ~= ARGV[3] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
