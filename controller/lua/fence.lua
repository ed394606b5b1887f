-- fence(meta; token) -> {'fenced'} | {'ok'}: raises the namespace's fence to a new leader's
-- token, so a deposed leader's writes here are refused even before the new one writes.

if not fence_ok(tonumber(ARGV[1])) then
  return {'fenced'}
end
return {'ok'}
