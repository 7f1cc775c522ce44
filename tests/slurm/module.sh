#!/usr/bin/env bash
# install.module: `cmake --install` into a fresh prefix, then in a clean shell
# `module use PREFIX/modulefiles; module load dt` (Lmod) puts the installed dt_train first on
# PATH, `dt_train --version` answers, the module's plugin path finds the installed CPU plugin
# (dt_train --runtime.device=cpu_shared trains with it, from the installed configs), the Slurm
# templates and hooks are in $DT_SLURM, `module unload dt` takes it all back, a moved
# installation still loads (the module finds its prefix from its own path), and so does the
# module reached from a site's module folder through a link (to its folder or to the file) or
# copied there; a copy whose installation is gone fails to load, naming where it looked.
#   module.sh WORKDIR DT_ROOT BUILD_DIR STATE_DIR MPIEXEC...
set -u
[ $# -ge 5 ] || { echo "usage: $0 WORKDIR DT_ROOT BUILD_DIR STATE_DIR MPIEXEC..." >&2; exit 2; }
WORK=$1 BUILD=$3 STATE=$4  # $2 (DT_ROOT) is not needed
shift 4
MPIEXEC="$*"
LMOD_INIT=/usr/share/lmod/lmod/init/bash
if [ -f "$STATE/unavailable" ]; then
  cat "$STATE/unavailable"
  exit 77
fi
if [ ! -f "$LMOD_INIT" ]; then
  echo "install.module: skipped: Lmod is not installed ($LMOD_INIT; scripts/bootstrap --slurm installs it)"
  exit 77
fi
rm -rf "$WORK"
mkdir -p "$WORK"
trap '[ -n "${DT_KEEP_TEST_DIR:-}" ] || rm -rf "$WORK"' EXIT
cd "$WORK" || exit 1
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }

P=$WORK/prefix
echo "=== cmake --install $BUILD --prefix $P"
cmake --install "$BUILD" --prefix "$P" >install.out 2>&1 || { cat install.out; fail "cmake --install failed"; }
for f in bin/dt_train bin/dt_topo bin/dt_ckpt lib/dt/plugins/libdt_hal_cpu_shared.so \
         share/dt/configs/micro.ini share/dt/configs/qos.ini share/dt/slurm/train.sbatch \
         share/dt/slurm/topo.sbatch share/dt/slurm/prolog share/dt/slurm/epilog \
         share/dt/slurm/qos-lib.sh include/dt/qos.hpp modulefiles/dt/0.1.0.lua; do
  [ -e "$P/$f" ] || fail "not installed: $f"
done

# in_module MODULE_DIR: runs the check script (stdin) in a clean shell with the module loaded
# from MODULE_DIR.
in_module() {
  env -i HOME="$WORK" PATH=/usr/local/bin:/usr/bin:/bin OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 TEXT="$TEXT" \
    MPIEXEC="$MPIEXEC" MDIR="$1" bash -c "source $LMOD_INIT && module use \"\$MDIR\" && module load dt && source /dev/stdin"
}
TEXT=/usr/share/common-licenses/GPL-3
echo "=== module use $P/modulefiles; module load dt"
in_module "$P/modulefiles" >M.out 2>&1 <<'CHECK'
echo "which: $(command -v dt_train)"
dt_train --version
echo "DT_PLUGIN_PATH=$DT_PLUGIN_PATH"
echo "CMAKE_PREFIX_PATH=$CMAKE_PREFIX_PATH"
echo "DT_SLURM=$DT_SLURM"
$MPIEXEC -n 1 dt_train --config "$DT_CONFIGS/micro.ini" --data.path="$TEXT" --train.steps=2 \
  --runtime.device=cpu_shared 2>&1 | grep -E "device|done"
module unload dt
echo "after unload: $(command -v dt_train || echo none)"
CHECK
sed 's/^/    /' M.out
grep -qx "which: $P/bin/dt_train" M.out || fail "dt_train is not the installed one"
grep -qx "dt_train (dt) 0.1.0" M.out || fail "no 'dt_train (dt) 0.1.0' from dt_train --version"
grep -qx "DT_PLUGIN_PATH=$P/lib/dt/plugins" M.out || fail "DT_PLUGIN_PATH not set by the module"
grep -q "^CMAKE_PREFIX_PATH=$P\\(:\\|\$\\)" M.out || fail "CMAKE_PREFIX_PATH does not start with $P"
grep -qx "DT_SLURM=$P/share/dt/slurm" M.out || fail "DT_SLURM not set by the module"
grep -q "device cpu_shared ($P/lib/dt/plugins/libdt_hal_cpu_shared.so)" M.out ||
  fail "dt_train did not train with the installed plugin"
grep -q "^dt_train: done: 2 steps" M.out || fail "the installed dt_train did not finish"
grep -qx "after unload: none" M.out || fail "module unload dt left dt_train on PATH"

# A site's module folders: a link to the module's folder (in a folder named otherwise, and in one
# named modulefiles elsewhere), a link to the file, a copy of the file.
S=$WORK/site
mkdir -p "$S/mf" "$S/other/modulefiles" "$S/filelink/dt" "$S/copy/dt"
ln -s "$P/modulefiles/dt" "$S/mf/dt"
ln -s "$P/modulefiles/dt" "$S/other/modulefiles/dt"
ln -s "$P/modulefiles/dt/0.1.0.lua" "$S/filelink/dt/0.1.0.lua"
cp "$P/modulefiles/dt/0.1.0.lua" "$S/copy/dt/"
for d in mf other/modulefiles filelink copy; do
  echo "=== module use $S/$d; module load dt"
  in_module "$S/$d" >S.out 2>&1 <<'CHECK'
echo "which: $(command -v dt_train)"
echo "DT_PREFIX=$DT_PREFIX"
CHECK
  sed 's/^/    /' S.out
  grep -qx "which: $P/bin/dt_train" S.out || fail "the module in $S/$d does not put $P/bin first"
  grep -qx "DT_PREFIX=$P" S.out || fail "the module in $S/$d does not set DT_PREFIX=$P"
done

echo "=== the installation moved to $WORK/moved"
mv "$P" "$WORK/moved"
in_module "$WORK/moved/modulefiles" >V.out 2>&1 <<'CHECK'
echo "which: $(command -v dt_train)"
dt_train --version
CHECK
sed 's/^/    /' V.out
grep -qx "which: $WORK/moved/bin/dt_train" V.out || fail "the moved installation's module points elsewhere"
grep -qx "dt_train (dt) 0.1.0" V.out || fail "the moved dt_train did not answer --version"

echo "=== the copy of the module, its installation gone"
if in_module "$S/copy" >G.out 2>&1 </dev/null; then
  fail "module load dt succeeded without an installation"
fi
sed 's/^/    /' G.out
tr -s ' \n' '  ' <G.out | grep -q "no installation of dt found for the module $S/copy/dt/0.1.0.lua: none of $P holds bin/dt_train" ||
  fail "the failed load does not say where it looked"
[ $FAILED -eq 0 ] && { echo "module.sh: PASS"; exit 0; }
echo "module.sh: FAIL"
exit 1
