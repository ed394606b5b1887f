-- retire(workers; token, wid, name) -> {'fenced'} | {'ok'}

if not fence_ok(tonumber(ARGV[1])) then
  return {'fenced'}
end
retire(tonumber(ARGV[2]), ARGV[3])
return {'ok'}
