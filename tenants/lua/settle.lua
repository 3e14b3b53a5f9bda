-- Settle one admission exactly once: refund (or charge) the difference between the tokens
-- reserved and the tokens used, release the stream leases, add the spend.
--
-- Two modes. 'settle': the caller knows the admission happened (it read the answer); apply
-- unless already settled. 'release': the caller lost the admission's answer (a timeout, a
-- cancelled call) and does not know whether it ran; give back everything only if it did
-- (state 'held'), and if it has not run yet leave a tombstone so that it takes nothing when
-- it does. Either way the outcome is the same whatever order the two arrive in.
--
-- KEYS[1] the request's state ('held' after admission, then 'settled' or 'cancelled')
-- KEYS[2] monthly token counter   KEYS[3] monthly spend counter (micro-USD)
-- KEYS[4 .. 3+nt] token buckets   KEYS[4+nt .. 3+nt+ns] stream lease sets
--
-- ARGV[1] nt   ARGV[2] ns   ARGV[3] request id   ARGV[4] reserved minus used tokens
-- ARGV[5] spend to add, micro-USD   ARGV[6] ttl (s) of the state left behind
-- ARGV[7] mode: 'settle' or 'release'   then per token bucket: capacity
--
-- Returns 1 when applied, 0 when there was nothing (more) to do.
redis.replicate_commands()

local state = redis.call('GET', KEYS[1])
local ttl = tonumber(ARGV[6])
if ARGV[7] == 'release' then
  if state ~= 'held' then
    if not state then
      redis.call('SET', KEYS[1], 'cancelled', 'EX', ttl)
    end
    return 0
  end
elseif state == 'settled' or state == 'cancelled' then
  return 0
end
redis.call('SET', KEYS[1], 'settled', 'EX', ttl)

local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local nt = tonumber(ARGV[1])
local ns = tonumber(ARGV[2])
local request_id = ARGV[3]
local refund = tonumber(ARGV[4])
local spend = tonumber(ARGV[5])

for i = 1, nt do
  local key = KEYS[3 + i]
  local cap = tonumber(ARGV[7 + i])
  local rate = cap / 60
  local bucket = redis.call('HMGET', key, 'l', 't')
  local level = cap
  if bucket[1] then
    level = tonumber(bucket[1]) + (now - tonumber(bucket[2])) * rate
    if level > cap then level = cap end
  end
  -- a full bucket stays full: what was refunded beyond it would have refilled anyway
  level = level + refund
  if level > cap then level = cap end
  redis.call('HSET', key, 'l', string.format('%.17g', level), 't', string.format('%.6f', now))
  redis.call('EXPIRE', key, math.ceil((cap - level) / rate) + 1)
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
