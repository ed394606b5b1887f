-- Key names and page-value layout shared by every namespace script; directory.py prepends this
-- file to each one (and namespace_write.lua to the scripts that write).
--
-- KEYS[1] is always the namespace meta hash "kvt:{<ns hex>}:m". Every other key a script
-- touches is derived from it and carries the same hash tag, so each script is single-slot
-- (Redis Cluster accepts undeclared keys of the declared key's slot).
--
-- Page value (hash kvt:{ns}:p:<E>, field = 16-byte page key):
--   parent key (16 bytes, zeros for depth 1) .. records sorted by worker id, 13 bytes each:
--   wid u24 | tier mask u8 | held children whose fastest tier is HBM u24 | ... DRAM u24 | ... NVMe u24
-- Mask bit (t - 1) is set for each tier t holding a copy. A record with mask 0 is a "ghost":
-- the worker dropped the page but still holds children of it (they are orphans).
--
-- Counters kept exact by every write, in hash kvt:{ns}:c:<E>: '1'..'3' (held pairs with a copy
-- in that tier), entries (held (page, worker) pairs), pages (pages with a holder), 'w:<wid>'
-- (pairs one worker holds); and, in the meta hash (for the current epoch, so lookups read them
-- with the epoch in one call):
--   orphans    = held (page, worker) pairs of depth > 1 whose parent the worker does not hold
--   inversions = held (parent, child) pairs of one worker whose child's fastest tier is faster
-- While both are 0, every worker's pages along a chain are prefix-closed and their fastest
-- tier never gets faster with depth, which lets lookup.lua bisect instead of reading every page.

local META = KEYS[1]
local PREFIX = string.sub(META, 1, -2)
local REC = 13
local FASTEST = {[0] = 0, 1, 2, 1, 3, 1, 2, 1}  -- tier mask -> fastest tier (0: none)

local function nskey(suffix)
  return PREFIX .. suffix
end

local function current_epoch()
  return tonumber(redis.call('HGET', META, 'epoch')) or 1
end

local function u24(s, p)
  local a, b, c = string.byte(s, p, p + 2)
  return a + 256 * b + 65536 * c
end

-- Held workers of a page value as a canonical string of (wid u24, fastest tier u8); equal
-- strings mean every worker holds the page in the same fastest tier.
local function projection(v)
  if #v == 16 + REC then  -- one record: the common case, without a table
    local mask = string.byte(v, 20)
    return mask ~= 0 and (string.sub(v, 17, 19) .. string.char(FASTEST[mask])) or ''
  end
  local parts = {}
  for p = 17, #v, REC do
    local mask = string.byte(v, p + 3)
    if mask ~= 0 then
      parts[#parts + 1] = string.sub(v, p, p + 2) .. string.char(FASTEST[mask])
    end
  end
  return table.concat(parts)
end
