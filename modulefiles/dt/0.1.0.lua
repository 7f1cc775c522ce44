-- Lmod module of dt 0.1.0, installed by `cmake --install` as PREFIX/modulefiles/dt/0.1.0.lua.
-- PREFIX is taken from this file's own location, so an installation can be moved or copied.
--   module use PREFIX/modulefiles; module load dt; dt_train --version
local prefix = (myFileName():gsub("/modulefiles/dt/[^/]+$", ""))

whatis("Name: dt")
whatis("Version: 0.1.0")
whatis("Description: distributed tensor computing and GPT training for Slurm clusters with MPI")
help([[
dt 0.1.0: dt_train, dt_topo, dt_ckpt and dt_trace in PREFIX/bin, the library and headers for
your own programs (CMAKE_PREFIX_PATH), device plugins in PREFIX/lib/dt/plugins (DT_PLUGIN_PATH),
configs in PREFIX/share/dt/configs ($DT_CONFIGS) and Slurm job scripts, prolog and epilog in
PREFIX/share/dt/slurm ($DT_SLURM):
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
