-- One admission, checked and taken atomically: all limits pass and are all taken, or
-- nothing is taken. Time comes from Redis TIME so every gateway process shares one clock.
--
-- KEYS[1]                    monthly token counter        (INCRBY reserved tokens)
-- KEYS[2]                    monthly spend counter, micro-USD (read only here)
-- KEYS[3]                    the request's state: set to 'held' when admitted; any value
--                            already there (a release that came first) means take nothing
-- KEYS[4 .. 3+nb]            token buckets (hash: l = level, t = last update, seconds)
-- KEYS[4+nb .. 3+nb+ns]      stream lease sets (zset: request id -> lease expiry)
--
-- ARGV[1] nb   ARGV[2] ns   ARGV[3] request id   ARGV[4] lease ttl (s)
-- ARGV[5] tokens to reserve   ARGV[6] monthly token budget (-1 = none)
-- ARGV[7] monthly spend budget, micro-USD (-1 = none)   ARGV[8] hard budget (1/0)
-- ARGV[9] how long the request's 'held' state lives (s): as long as a deferred settle or
--         release of it may still be retried, so that one always finds it
-- then per bucket: capacity, cost, kind ("r" requests / "t" tokens)
-- then per lease set: concurrent stream limit
--
-- Returns strings (Redis would truncate Lua floats): allowed, error, limit, retry after,
-- then limit / remaining / reset-seconds for requests and for tokens, month tokens used,
-- month spend used.
redis.replicate_commands()

local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000

local nb = tonumber(ARGV[1])
local ns = tonumber(ARGV[2])
local request_id = ARGV[3]
local lease_ttl = tonumber(ARGV[4])
local reserve = tonumber(ARGV[5])
local token_budget = tonumber(ARGV[6])
local spend_budget = tonumber(ARGV[7])
local hard = ARGV[8] == '1'
local state_ttl = tonumber(ARGV[9])
local WINDOW = 60

local buckets = {}
for i = 1, nb do
  local base = 9 + (i - 1) * 3
  local cap = tonumber(ARGV[base + 1])
  local b = { key = KEYS[3 + i], cap = cap, cost = tonumber(ARGV[base + 2]),
              kind = ARGV[base + 3], rate = cap / WINDOW }
  local state = redis.call('HMGET', b.key, 'l', 't')
  if state[1] then
    local level = tonumber(state[1]) + (now - tonumber(state[2])) * b.rate
    if level > cap then level = cap end
    b.level = level
  else
    b.level = cap
  end
  buckets[i] = b
end

local function header_values(kind, taken)
  -- the tightest bucket of a kind is the one the caller will hit first
  local best = nil
  for _, b in ipairs(buckets) do
    if b.kind == kind then
      local left = b.level
      if taken then left = left - b.cost end
      if best == nil or left < best.left then best = { cap = b.cap, left = left, rate = b.rate } end
    end
  end
  if best == nil then return { '', '', '' } end
  local remaining = math.max(0, math.floor(best.left))
  local reset = (best.cap - best.left) / best.rate
  if reset < 0 then reset = 0 end
  return { tostring(best.cap), tostring(remaining), string.format('%.3f', reset) }
end

local used_tokens = tonumber(redis.call('GET', KEYS[1]) or '0')
local used_spend = tonumber(redis.call('GET', KEYS[2]) or '0')

local function answer(allowed, err, limit, retry, taken)
  local r = header_values('r', taken)
  local t = header_values('t', taken)
  return { allowed, err, limit, retry, r[1], r[2], r[3], t[1], t[2], t[3],
           tostring(used_tokens), tostring(used_spend) }
end

-- A release for this request id ran first (its caller gave up waiting for this answer):
-- take nothing, or what was taken would never be given back.
if redis.call('EXISTS', KEYS[3]) == 1 then
  return answer('0', 'request_cancelled', '', '', false)
end

-- Budgets first: an exhausted budget is not cured by waiting a few seconds.
if hard then
  if token_budget >= 0 and used_tokens + reserve > token_budget then
    return answer('0', 'insufficient_quota', 'monthly_token_budget', '', false)
  end
  if spend_budget >= 0 and used_spend >= spend_budget then
    return answer('0', 'insufficient_quota', 'monthly_spend_budget', '', false)
  end
end

local worst_retry = -1
local worst_limit = nil
for _, b in ipairs(buckets) do
  if b.cost > b.cap then
    return answer('0', 'rate_limit_exceeded', b.kind == 'r' and 'requests' or 'tokens_request_too_large', '', false)
  end
  if b.cost > b.level then
    local retry = (b.cost - b.level) / b.rate
    if retry > worst_retry then
      worst_retry = retry
      worst_limit = b.kind == 'r' and 'requests' or 'tokens'
    end
  end
end
if worst_limit then
  return answer('0', 'rate_limit_exceeded', worst_limit, string.format('%.3f', worst_retry), false)
end

for j = 1, ns do
  local key = KEYS[3 + nb + j]
  local limit = tonumber(ARGV[9 + nb * 3 + j])
  -- leases of crashed holders have expired: drop them before counting
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZCARD', key) >= limit then
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    local retry = 1
    if first[2] then retry = math.min(1, tonumber(first[2]) - now) end
    return answer('0', 'rate_limit_exceeded', 'concurrent_streams', string.format('%.3f', retry), false)
  end
end

-- Every check passed: take everything.
for _, b in ipairs(buckets) do
  local level = b.level - b.cost
  redis.call('HSET', b.key, 'l', string.format('%.17g', level), 't', string.format('%.6f', now))
  redis.call('EXPIRE', b.key, math.ceil((b.cap - level) / b.rate) + 1)
end
for j = 1, ns do
  local key = KEYS[3 + nb + j]
  redis.call('ZADD', key, now + lease_ttl, request_id)
  redis.call('EXPIRE', key, lease_ttl + 60)
end
-- Marks the reservation as taken, so a release (sent when the answer was lost) gives it back.
redis.call('SET', KEYS[3], 'held', 'EX', state_ttl)
used_tokens = redis.call('INCRBY', KEYS[1], reserve)
redis.call('EXPIRE', KEYS[1], 40 * 86400)
return answer('1', '', '', '', true)
