-- Whether a learner slot holds a live session now: its lease runs past this instant of
-- Redis time (`hello.lua` takes it, `heartbeat.lua` renews it, `leave.lua` drops it).
-- KEYS: learners   ARGV: id
-- Returns: 1 (live) or 0
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(lease) > now then return 1 end
return 0
