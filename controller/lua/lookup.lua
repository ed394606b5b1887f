#!lua flags=no-writes
-- lookup(meta; packed_keys) -> {epoch, wid_1, tiers_1, wid_2, tiers_2, ...}
--
-- ARGV[1]: the query chain, 16-byte page keys concatenated, depth 1 first (key i's parent is
-- key i - 1). For every worker holding the depth-1 page, tiers_w has one byte per page the
-- worker holds *contiguously from depth 1*: the fastest tier with a copy. Workers are sorted by
-- id. Liveness is filtered by the caller (leases live in another slot).
--
-- Fast path, while the namespace has no orphans and no tier inversions (namespace_keys.lua):
-- each worker's state along the chain (fastest tier, then "absent") only gets worse with depth,
-- so the deepest present page is found by bisection, and an interval whose two ends have the
-- same holder projection is constant inside. Cost: O(runs x log depth) HGETs, 2 for a chain
-- held in one tier. Otherwise, or past a probe budget: one HMGET of the whole chain.

local sub = string.sub
local packed = ARGV[1]
local n = #packed / 16
local meta = redis.call('HMGET', META, 'epoch', 'orphans', 'inversions')
local epoch = tonumber(meta[1]) or 1
local out = {epoch}
if n == 0 then
  return out
end
local pages = PREFIX .. 'p:' .. epoch

local vals, projs = {}, {}
local probes = 0
local segs = {}  -- runs of equal projection in depth order: {first, last, projection}

local function probe(i)
  local v = vals[i]
  if v == nil then
    v = redis.call('HGET', pages, sub(packed, 16 * i - 15, 16 * i)) or false
    vals[i] = v
    projs[i] = v and projection(v) or ''
    probes = probes + 1
  end
  return v
end

local ordered = n >= 8 and (tonumber(meta[2]) or 0) == 0 and (tonumber(meta[3]) or 0) == 0
if ordered then
  -- Both ends in one call: for a full hit that is usually all it takes.
  local ends = redis.call('HMGET', pages, sub(packed, 1, 16), sub(packed, 16 * n - 15, 16 * n))
  for j, i in ipairs({1, n}) do
    local v = ends[j] or false
    vals[i] = v
    projs[i] = v and projection(v) or ''
  end
  probes = 2
  local depth = n
  if not vals[n] then
    local lo, hi = 0, n - 1
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if probe(mid) then lo = mid else hi = mid - 1 end
    end
    depth = lo
  end
  if depth > 0 then
    -- Intervals [a, b) with both ends probed, on an explicit stack (right half pushed first).
    local budget = math.max(8, math.floor(n / 4))
    local stack = {{1, depth}}
    while #stack > 0 do
      local top = table.remove(stack)
      local a, b = top[1], top[2]
      if a < b then
        if projs[a] == projs[b] or b == a + 1 then
          segs[#segs + 1] = {a, b - 1, projs[a]}
        elseif probes >= budget then
          ordered = false
          break
        else
          local m = math.floor((a + b) / 2)
          probe(m)
          stack[#stack + 1] = {m, b}
          stack[#stack + 1] = {a, m}
        end
      end
    end
    local last = segs[#segs]
    if last and last[3] == projs[depth] then
      last[2] = depth
    else
      segs[#segs + 1] = {depth, depth, projs[depth]}
    end
  end
end

if not ordered then
  segs = {}
  local chunk = 512
  local done = false
  for base = 0, n - 1, chunk do
    local m = math.min(chunk, n - base)
    local fields = {}
    for j = 1, m do
      local o = (base + j) * 16
      fields[j] = sub(packed, o - 15, o)
    end
    local got = redis.call('HMGET', pages, unpack(fields))
    for j = 1, m do
      local v = got[j]
      local p = v and projection(v) or ''
      if p == '' then
        done = true
        break
      end
      local last = segs[#segs]
      if last and last[3] == p then
        last[2] = base + j
      else
        segs[#segs + 1] = {base + j, base + j, p}
      end
    end
    if done then
      break
    end
  end
end

if #segs == 1 then  -- every holder holds the whole match in one tier
  local p, len = segs[1][3], segs[1][2]
  for q = 1, #p, 4 do
    out[#out + 1] = u24(p, q)
    out[#out + 1] = string.rep(sub(p, q + 3, q + 3), len)
  end
  return out
end

-- Walk the segments; a worker's run ends at the first segment without it.
local runs, order, closed = {}, {}, {}
local first = segs[1]
if first then
  local p = first[3]
  for q = 1, #p, 4 do
    local w = u24(p, q)
    runs[w] = {}
    order[#order + 1] = w
  end
end
for _, seg in ipairs(segs) do
  local p = seg[3]
  local len = seg[2] - seg[1] + 1
  local seen = {}
  for q = 1, #p, 4 do
    local w = u24(p, q)
    local r = runs[w]
    if r and not closed[w] then
      seen[w] = true
      r[#r + 1] = string.rep(sub(p, q + 3, q + 3), len)
    end
  end
  for _, w in ipairs(order) do
    if not seen[w] then
      closed[w] = true
    end
  end
end
for _, w in ipairs(order) do
  out[#out + 1] = w
  out[#out + 1] = table.concat(runs[w])
end
return out
