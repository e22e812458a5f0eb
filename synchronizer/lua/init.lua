-- Set the job's initial parameters once (set-if-absent over the whole model). Values and
-- optimizer states were staged under their own keys; they are renamed into place, or
-- dropped if the job is already initialized.
-- KEYS: init, then per fragment i (P of each, in this order): frag_i, round_i, theta_i,
--       opt_i, stage_theta_i, stage_opt_i
-- ARGV: P
local p = tonumber(ARGV[1])
local function key(kind, i) return KEYS[1 + kind * p + i] end
if redis.call('EXISTS', KEYS[1]) == 1 then
  for i = 1, p do redis.call('DEL', key(4, i), key(5, i)) end
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, p do
  redis.call('RENAME', key(4, i), key(2, i))
  redis.call('RENAME', key(5, i), key(3, i))
  redis.call('HSET', key(0, i), 'version', 0, 'committed_ms', now)
  redis.call('HSET', key(1, i), 'opened_ms', now)
end
redis.call('SET', KEYS[1], now)
return 1
