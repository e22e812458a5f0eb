-- Extend a merge lease the caller still holds (a long merge keeps it; a dead replica's
-- lease runs out quickly).
-- KEYS: lease   ARGV: token, ttl_ms
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
