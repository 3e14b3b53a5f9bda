-- One admission, checked and taken atomically: all limits pass and are all taken, or
-- nothing is taken. Time comes from Redis TIME so every gateway process shares one clock.
--
-- KEYS[1]                    monthly token counter        (INCRBY reserved tokens)
-- KEYS[2]                    monthly spend counter, micro-USD (read only here)
-- KEYS[3]                    the request's state: set to 'held:<second>' when admitted (the
--                            window second its tokens were counted in, for the settle); a
--                            'held' already there means this admission ran before (answer
--                            allowed again, take nothing); any other value (a release that came
--                            first) means take nothing and refuse
-- KEYS[4 .. 3+nb]            per-minute windows (hash: s = amount in the window, o = oldest
--                            second still counted, n = newest second, <second> = amount taken
--                            in that second)
-- KEYS[4+nb .. 3+nb+ns]      lease sets (zset: request id -> lease expiry)
--
-- ARGV[1] nb   ARGV[2] ns   ARGV[3] request id   ARGV[4] lease ttl (s)
-- ARGV[5] tokens to reserve   ARGV[6] monthly token budget (-1 = none)
-- ARGV[7] monthly spend budget, micro-USD (-1 = none)   ARGV[8] hard budget (1/0)
-- ARGV[9] how long the request's 'held' state lives (s): as long as a deferred settle or
--         release of it may still be retried, so that one always finds it
-- ARGV[10] the time to use in place of TIME, epoch seconds ('' = TIME; tests only)
-- then per window: limit, cost, kind ("r" requests / "t" tokens)
-- then per lease set: concurrent request limit
--
-- A window counts what was taken in the current whole second and the 60 before it, so any
-- 60 s span (which touches at most 61 whole seconds) holds at most the limit. Each admission
-- drops the seconds that left the window from the running total: O(1) amortized, at most 61
-- steps after an idle spell.
--
-- Returns strings (Redis would truncate Lua floats): allowed, error, limit, retry after,
-- then limit / remaining / reset-seconds for requests and for tokens, month tokens used,
-- month spend used.
redis.replicate_commands()

local now
if ARGV[10] ~= '' then
  now = tonumber(ARGV[10])
else
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
end

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
local second = math.floor(now)
local first = second - WINDOW  -- the oldest second still in the window

-- The window's total, once the seconds that have left it are dropped.
local function current_total(key)
  local state = redis.call('HMGET', key, 's', 'o', 'n')
  local total = tonumber(state[1]) or 0
  local oldest = tonumber(state[2])
  local newest = tonumber(state[3]) or first
  if oldest == nil or oldest >= first then return total, newest end
  -- what an admission wrote lies in [its first, its first + WINDOW]
  if oldest + WINDOW < first then
    redis.call('DEL', key)
    return 0, first
  end
  for s = oldest, first - 1 do
    local amount = redis.call('HGET', key, s)
    if amount then
      total = total - tonumber(amount)
      redis.call('HDEL', key, s)
    end
  end
  redis.call('HSET', key, 's', total, 'o', first)
  return total, newest
end

local buckets = {}
for i = 1, nb do
  local base = 10 + (i - 1) * 3
  local b = { key = KEYS[3 + i], cap = tonumber(ARGV[base + 1]), cost = tonumber(ARGV[base + 2]),
              kind = ARGV[base + 3] }
  b.used, b.newest = current_total(b.key)
  buckets[i] = b
end

-- Seconds until enough of the window has left it for `b.cost` to fit.
local function wait_for_room(b)
  local left = b.used
  for s = first, second do
    left = left - tonumber(redis.call('HGET', b.key, s) or '0')
    if left + b.cost <= b.cap then return s + WINDOW + 1 - now end
  end
  return second + WINDOW + 1 - now
end

local function header_values(kind, taken)
  -- the tightest window of a kind is the one the caller will hit first
  local best = nil
  for _, b in ipairs(buckets) do
    if b.kind == kind then
      local used, newest = b.used, b.newest
      if taken then used, newest = used + b.cost, second end
      if best == nil or b.cap - used < best.left then
        best = { cap = b.cap, left = b.cap - used, used = used, newest = newest }
      end
    end
  end
  if best == nil then return { '', '', '' } end
  -- reset: when the window is empty again
  local reset = 0
  if best.used > 0 then reset = math.max(0, best.newest + WINDOW + 1 - now) end
  return { tostring(best.cap), tostring(math.max(0, best.left)), string.format('%.3f', reset) }
end

local used_tokens = tonumber(redis.call('GET', KEYS[1]) or '0')
local used_spend = tonumber(redis.call('GET', KEYS[2]) or '0')

local function answer(allowed, err, limit, retry, taken)
  local r = header_values('r', taken)
  local t = header_values('t', taken)
  return { allowed, err, limit, retry, r[1], r[2], r[3], t[1], t[2], t[3],
           tostring(used_tokens), tostring(used_spend) }
end

local state = redis.call('GET', KEYS[3])
if state then
  -- This admission ran before and only its answer was lost (the client retried it on a new
  -- connection): answer as it was answered, taking nothing twice.
  if string.sub(state, 1, 4) == 'held' then return answer('1', '', '', '', false) end
  -- A release for this request id ran first (its caller gave up waiting for this answer):
  -- take nothing, or what was taken would never be given back.
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
  if b.used + b.cost > b.cap then
    local retry = wait_for_room(b)
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
  local limit = tonumber(ARGV[10 + nb * 3 + j])
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
  redis.call('HINCRBY', b.key, second, b.cost)
  redis.call('HSET', b.key, 's', b.used + b.cost, 'o', first, 'n', second)
  -- gone once its newest second has left the window
  redis.call('EXPIRE', b.key, WINDOW + 2)
end
for j = 1, ns do
  local key = KEYS[3 + nb + j]
  redis.call('ZADD', key, now + lease_ttl, request_id)
  redis.call('EXPIRE', key, lease_ttl + 60)
end
-- Marks the reservation as taken, so a release (sent when the answer was lost) gives it back.
redis.call('SET', KEYS[3], 'held:' .. string.format('%d', second), 'EX', state_ttl)
used_tokens = redis.call('INCRBY', KEYS[1], reserve)
redis.call('EXPIRE', KEYS[1], 40 * 86400)
return answer('1', '', '', '', true)
