-- Write-side helpers: fencing, page-value decoding, and a batch that keeps every counter
-- exact. Prepended after namespace_keys.lua to the scripts that write.

local NO_PARENT = string.rep('\0', 16)

-- Fencing ratchet: a token below the highest one this namespace has seen is refused; a higher
-- one raises the namespace's fence so the previous leader's tokens are refused from now on.
local function fence_ok(token)
  local fence = tonumber(redis.call('HGET', META, 'fence')) or 0
  if token < fence then
    return false
  end
  if token > fence then
    redis.call('HSET', META, 'fence', token)
  end
  return true
end

local function p24(x)
  return string.char(x % 256, math.floor(x / 256) % 256, math.floor(x / 65536))
end

-- Node = decoded page value: {parent = 16 bytes, recs = {[wid] = {mask, nH, nD, nN}}}.
local function decode(v)
  local recs = {}
  for p = 17, #v, REC do
    recs[u24(v, p)] = {string.byte(v, p + 3), u24(v, p + 4), u24(v, p + 7), u24(v, p + 10)}
  end
  return {parent = string.sub(v, 1, 16), recs = recs}
end

local function encode(node)
  local wids = {}
  for w in pairs(node.recs) do
    wids[#wids + 1] = w
  end
  if #wids == 0 then
    return nil
  end
  table.sort(wids)
  local parts = {node.parent}
  for _, w in ipairs(wids) do
    local r = node.recs[w]
    parts[#parts + 1] = p24(w) .. string.char(r[1]) .. p24(r[2]) .. p24(r[3]) .. p24(r[4])
  end
  return table.concat(parts)
end

-- A write batch: decoded nodes cached by key, written back once by flush().
local function new_batch(epoch, wid)
  return {
    epoch = epoch, wid = wid, pages = nskey('p:' .. epoch), index = nskey('w:' .. epoch .. ':' .. wid),
    nodes = {}, dirty = {}, tiers = {0, 0, 0}, entries = 0, pages_held = 0, orphans = 0, inversions = 0,
    indexed = false, unindexed = false,
  }
end

local function load_node(b, key)
  local node = b.nodes[key]
  if node == nil then
    local v = redis.call('HGET', b.pages, key)
    node = v and decode(v) or false
    b.nodes[key] = node
  end
  return node or nil
end

-- Sets the batch worker's tier mask on `key` (node must exist) and keeps every counter exact.
-- With `purge`, the record is deleted even if it still has children (they become orphans).
local function set_mask(b, key, node, new_mask, purge)
  local wid = b.wid
  local rec = node.recs[wid]
  if not rec then
    rec = {0, 0, 0, 0}
    node.recs[wid] = rec
    redis.call('SADD', b.index, key)
    b.indexed = true
  end
  local old_mask = rec[1]
  local f_old, f_new = FASTEST[old_mask], FASTEST[new_mask]
  rec[1] = new_mask
  b.dirty[key] = true
  for t = 1, 3 do
    local bitv = bit.lshift(1, t - 1)
    local was, now = bit.band(old_mask, bitv) ~= 0, bit.band(new_mask, bitv) ~= 0
    if was ~= now then
      b.tiers[t] = b.tiers[t] + (now and 1 or -1)
    end
  end
  if f_old ~= f_new then
    if f_old == 0 or f_new == 0 then
      local delta = (f_old == 0) and 1 or -1
      b.entries = b.entries + delta
      local others = false
      for w, r in pairs(node.recs) do
        if w ~= wid and r[1] ~= 0 then
          others = true
          break
        end
      end
      if not others then
        b.pages_held = b.pages_held + delta
      end
    end
    -- The edge to the parent (depth > 1).
    if node.parent ~= NO_PARENT then
      local pnode = load_node(b, node.parent)
      local prec = pnode and pnode.recs[wid]
      local pf = prec and FASTEST[prec[1]] or 0
      if f_old ~= 0 then
        if prec then
          prec[f_old + 1] = prec[f_old + 1] - 1
        end
        if pf == 0 then
          b.orphans = b.orphans - 1
        elseif f_old < pf then
          b.inversions = b.inversions - 1
        end
      end
      if f_new ~= 0 then
        if prec then
          prec[f_new + 1] = prec[f_new + 1] + 1
        end
        if pf == 0 then
          b.orphans = b.orphans + 1
        elseif f_new < pf then
          b.inversions = b.inversions + 1
        end
      end
      if prec then
        b.dirty[node.parent] = true
        if prec[1] == 0 and prec[2] + prec[3] + prec[4] == 0 then
          pnode.recs[wid] = nil  -- a ghost whose last child left
          redis.call('SREM', b.index, node.parent)
          b.unindexed = true
        end
      end
    end
    -- The edges to this page's own held children.
    local c1, c2, c3 = rec[2], rec[3], rec[4]
    local function terms(f)
      if f == 0 then
        return 0, c1 + c2 + c3
      end
      return (f >= 2 and c1 or 0) + (f >= 3 and c2 or 0), 0
    end
    local inv_old, orph_old = terms(f_old)
    local inv_new, orph_new = terms(f_new)
    b.inversions = b.inversions + inv_new - inv_old
    b.orphans = b.orphans + orph_new - orph_old
  end
  -- A purged record's children stay counted as orphans until they are removed themselves.
  if new_mask == 0 and (purge or rec[2] + rec[3] + rec[4] == 0) then
    node.recs[wid] = nil
    redis.call('SREM', b.index, key)
    b.unindexed = true
  end
end

local function flush(b)
  for key in pairs(b.dirty) do
    local v = encode(b.nodes[key])
    if v then
      redis.call('HSET', b.pages, key, v)
    else
      redis.call('HDEL', b.pages, key)
    end
  end
  local counts = nskey('c:' .. b.epoch)
  for t = 1, 3 do
    if b.tiers[t] ~= 0 then
      redis.call('HINCRBY', counts, t, b.tiers[t])
    end
  end
  for field, delta in pairs({entries = b.entries, pages = b.pages_held}) do
    if delta ~= 0 then
      redis.call('HINCRBY', counts, field, delta)
    end
  end
  for field, delta in pairs({orphans = b.orphans, inversions = b.inversions}) do
    if delta ~= 0 then
      redis.call('HINCRBY', META, field, delta)
    end
  end
  if b.entries ~= 0 then
    redis.call('HINCRBY', counts, 'w:' .. b.wid, b.entries)
  end
  local holders = nskey('ws:' .. b.epoch)
  if b.indexed then
    redis.call('SADD', holders, b.wid)
  end
  if b.unindexed and redis.call('EXISTS', b.index) == 0 then
    redis.call('SREM', holders, b.wid)
    redis.call('HDEL', counts, 'w:' .. b.wid)
  end
end
