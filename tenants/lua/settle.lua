-- Settle one admission exactly once: refund (or charge) the difference between the tokens
-- reserved and the tokens used, release the stream leases, add the spend.
--
-- Two modes. 'settle': the caller knows the admission happened (it read the answer); apply
-- unless already settled. 'release': the caller lost the admission's answer (a timeout, a
-- cancelled call) and does not know whether it ran; give back everything only if it did
-- (state 'held:...'), and if it has not run yet leave a tombstone so that it takes nothing when
-- it does. Either way the outcome is the same whatever order the two arrive in.
--
-- KEYS[1] the request's state ('held:<second>' after admission, then 'settled' or
--         'cancelled'; <second> is the window second its tokens were counted in)
-- KEYS[2] monthly token counter   KEYS[3] monthly spend counter (micro-USD)
-- KEYS[4 .. 3+nt] token windows   KEYS[4+nt .. 3+nt+ns] lease sets
--
-- ARGV[1] nt   ARGV[2] ns   ARGV[3] request id   ARGV[4] reserved minus used tokens
-- ARGV[5] spend to add, micro-USD   ARGV[6] ttl (s) of the state left behind
-- ARGV[7] mode: 'settle' or 'release'
--
-- Returns 1 when applied, 0 when there was nothing (more) to do.
redis.replicate_commands()

local state = redis.call('GET', KEYS[1])
local ttl = tonumber(ARGV[6])
-- the second the admission was counted in (none in a plain 'held' from before windows)
local second = state and string.match(state, '^held:(%d+)$')
if ARGV[7] == 'release' then
  if not second and state ~= 'held' then
    if not state then
      redis.call('SET', KEYS[1], 'cancelled', 'EX', ttl)
    end
    return 0
  end
elseif state == 'settled' or state == 'cancelled' then
  return 0
end
redis.call('SET', KEYS[1], 'settled', 'EX', ttl)

local nt = tonumber(ARGV[1])
local ns = tonumber(ARGV[2])
local request_id = ARGV[3]
local refund = tonumber(ARGV[4])
local spend = tonumber(ARGV[5])

-- The difference goes to the second the reservation was counted in, while the window still
-- holds it: once that second has left, there is nothing to give back (and a charge beyond
-- the reservation is not counted against the window).
for i = 1, nt do
  local key = KEYS[3 + i]
  local counted = second and redis.call('HGET', key, second)
  if counted and refund ~= 0 then
    local change = -refund
    if tonumber(counted) + change < 0 then change = -tonumber(counted) end
    redis.call('HINCRBY', key, second, change)
    redis.call('HINCRBY', key, 's', change)
  end
end

for j = 1, ns do
  redis.call('ZREM', KEYS[3 + nt + j], request_id)
end

if refund ~= 0 then
  redis.call('INCRBY', KEYS[2], -refund)
end
if spend > 0 then
  redis.call('INCRBY', KEYS[3], spend)
  redis.call('EXPIRE', KEYS[3], 40 * 86400)
end
return 1
