-- Take the merge lease of one fragment if free; return its fencing token, or 0.
-- KEYS: lease, fence   ARGV: ttl_ms
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
return token
