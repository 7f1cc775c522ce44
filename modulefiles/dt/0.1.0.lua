-- Lmod module of dt 0.1.0, installed by `cmake --install` as PREFIX/modulefiles/dt/0.1.0.lua.
--   module use PREFIX/modulefiles; module load dt; dt_train --version
-- PREFIX is the first of these that holds bin/dt_train: the one this file's own location names
-- (an installation moved or copied whole), the one its real location names (a site's module
-- folder holding a link to PREFIX/modulefiles/dt or to this file), and the prefix it was
-- installed into (a copy of this file elsewhere). A load finding none stops with an error.
local function prefix_of(file)
  return file and file:match("^(.*)/modulefiles/dt/[^/]+$") or ""
end
local tried = {}
for _, p in ipairs({prefix_of(myFileName()), prefix_of(abspath and abspath(myFileName())),
                    "@DT_INSTALL_PREFIX@"}) do  -- the last replaced by `cmake --install`
  if p ~= "" and p ~= tried[#tried] then tried[#tried + 1] = p end
end
local prefix
for _, p in ipairs(tried) do
  if isFile(pathJoin(p, "bin/dt_train")) then
    prefix = p
    break
  end
end
if not prefix then
  if mode() == "load" then
    LmodError("dt: no installation of dt found for the module " .. myFileName() .. ": none of " ..
              table.concat(tried, ", ") .. " holds bin/dt_train")
  end
  prefix = tried[1] or ""
end

whatis("Name: dt")
whatis("Version: 0.1.0")
whatis("Description: distributed tensor computing and GPT training for Slurm clusters with MPI")
help([[
dt 0.1.0: dt_train, dt_topo, dt_ckpt, dt_trace and dt_bench in PREFIX/bin, the library and
headers for your own programs (CMAKE_PREFIX_PATH: find_package(dt CONFIG), dt::dt), device
plugins in PREFIX/lib/dt/plugins (DT_PLUGIN_PATH) and the skeleton of a new one in
PREFIX/share/dt/hal, configs in PREFIX/share/dt/configs ($DT_CONFIGS) and Slurm job scripts,
prolog and epilog in PREFIX/share/dt/slurm ($DT_SLURM):
  sbatch $DT_SLURM/train.sbatch $DT_CONFIGS/gpt-tiny.ini --data.path=... --ckpt.dir=...
]])

conflict("dt")
prepend_path("PATH", pathJoin(prefix, "bin"))
prepend_path("LD_LIBRARY_PATH", pathJoin(prefix, "lib"))
prepend_path("CMAKE_PREFIX_PATH", prefix)
prepend_path("DT_PLUGIN_PATH", pathJoin(prefix, "lib/dt/plugins"))
setenv("DT_PREFIX", prefix)
setenv("DT_CONFIGS", pathJoin(prefix, "share/dt/configs"))
setenv("DT_SLURM", pathJoin(prefix, "share/dt/slurm"))
