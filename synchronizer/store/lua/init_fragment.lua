-- Set a fragment's initial value once (set-if-absent): the pointer to objects written first.
-- KEYS: frag   ARGV: value_name, state_name
-- Returns 1 if set now, 0 if the fragment already had a value.
if redis.call('HEXISTS', KEYS[1], 'version') == 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'version', 0, 'committed_ms', now, 'value', ARGV[1],
  'state', ARGV[2], 'delta', '')
return 1
