-- Commit one merged round: only by the fragment's owner at its epoch (fencing), and only onto
-- the version the merge was computed from, so each round commits exactly once. The new value,
-- optimizer state and delta were written to the tensor store first; this swings the pointer
-- to them, marks the merged updates committed and keeps the fragment's counters.
-- KEYS: frag, owner, round, log, stats, orphans, seen_1..seen_n (the merged updates' slots'
--       records)
-- ARGV: replica, epoch, expected_version, value_name, state_name, delta_name, log_entry,
--       useful_seconds, tokens_merged, stale_folded, log_keep, n,
--       (uid_i, seq_i, incarnation_i) x n
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
-- Every number is checked before anything is written: a script stopped by an error half-way
-- would leave its earlier writes in place.
for _, i in ipairs({8, 9, 10}) do
  local x = tonumber(ARGV[i])
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return {'bad_args', v} end
end
if redis.call('GET', KEYS[2]) ~= ARGV[1] .. ' ' .. ARGV[2] then return {'lost_lease', v} end
if v ~= tonumber(ARGV[3]) then return {'version_moved', v} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
v = v + 1
redis.call('HSET', KEYS[1], 'version', v, 'committed_ms', now, 'value', ARGV[4],
  'state', ARGV[5], 'delta', ARGV[6])
local n = tonumber(ARGV[12])
for i = 1, n do
  local uid, seq, incarnation = ARGV[10 + 3 * i], ARGV[11 + 3 * i], ARGV[12 + 3 * i]
  redis.call('HDEL', KEYS[3], uid)
  -- The slot's records may be a newer incarnation's by now: then this seq is not theirs,
  -- and the uid was kept apart as an orphan (`receive.lua`) until now.
  if redis.call('HGET', KEYS[6 + i], 'incarnation') == incarnation then
    local seen = redis.call('HGET', KEYS[6 + i], seq)
    if seen then redis.call('HSET', KEYS[6 + i], seq, string.sub(seen, 1, -2) .. 'c') end
  else
    redis.call('SREM', KEYS[6], uid)
  end
end
redis.call('HINCRBYFLOAT', KEYS[5], 'useful_seconds', ARGV[8])
redis.call('HINCRBYFLOAT', KEYS[5], 'tokens_merged', ARGV[9])
redis.call('HINCRBY', KEYS[5], 'stale_folded', ARGV[10])
redis.call('HINCRBY', KEYS[5], 'versions_committed', 1)
redis.call('RPUSH', KEYS[4], ARGV[7])
redis.call('LTRIM', KEYS[4], -tonumber(ARGV[11]), -1)
return {'committed', v}
