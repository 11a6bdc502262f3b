#!/usr/bin/env bash
# Runs CRIU's own test suite (zdtm, its static tests) through hiber, as a user would, and
# through CRIU alone, so that the two compare test by test.
#
#   scripts/zdtm.sh [--modes LIST] [--results FILE] [--list] [NAME...]
#
# Each applicable test runs in up to four modes, one line each (`NAME MODE pass`,
# `NAME MODE fail(reason)`, `NAME MODE skip(reason)`), then a summary:
#   baseline  the test alone, no checkpoint (`zdtm.py run --nocr`): a test that fails here
#             is skipped in the other modes;
#   criu      CRIU alone, as zdtm.py drives it (`zdtm.py run`, the installed CRIU, with
#             the test's own options from its .desc);
#   stop      a hiber job (`hiber run`), `hiber checkpoint` (which stops it), `hiber
#             restore`, then the restored test is told to finish (SIGTERM) and gives its
#             verdict;
#   leave     `hiber checkpoint --leave-running`, a copy restored beside the original that
#             still runs (`--isolate-net`, as a copy beside its original needs for its
#             sockets), then both are told to finish, the copy first: both must pass.
#             Both work on the same files: a test that removes its own files as it ends
#             leaves the other without them (the reason then says so).
# NAME... runs those tests only (`scripts/zdtm.sh pty00 fifo`); --modes takes a comma list
# (default baseline,criu,stop,leave); --list prints the applicable tests and why the others
# do not apply. Results go to FILE (default .deps/zdtm/results/DATE.tsv) as
# `NAME<TAB>MODE<TAB>RESULT<TAB>REASON` lines, and the CRIU and hiber logs of failures stay
# under .deps/zdtm/logs/.
#
# The tests come from the CRIU source tarball scripts/setup.sh fetched, built once into
# .deps/zdtm/ (about a minute); the installed CRIU (/usr/local/sbin/criu) does the work.
# A test applies as zdtm.py decides for a host run: its architecture, not `noauto`, the CRIU
# features it needs present (`criu check --feature`), its .checkskip passing, and a `h`
# (host) flavour: the `ns`/`uns` flavours need zdtm's own root filesystem.
#
# Environment: HIBER (the hiber binary; default target/release/hiber, else target/debug),
# HIBER_STATE (default /tmp/hiber-zdtm-state: a state directory of the script's own, whose
# jobs it removes), CRIU (default /usr/local/sbin/criu), HIBER_ZDTM_DIR (default .deps/zdtm).
# Needs root, as CRIU does. A full run takes about 35 minutes on 2 cores.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
deps=${HIBER_DEPS:-$repo/.deps}
work=${HIBER_ZDTM_DIR:-$deps/zdtm}
tarball=$deps/criu_4.1.1.orig.tar.xz
src=$work/criu-4.1.1
static=$src/test/zdtm/static
criu=${CRIU:-/usr/local/sbin/criu}
export HIBER_STATE=${HIBER_STATE:-/tmp/hiber-zdtm-state}
if [ -z "${HIBER:-}" ]; then
    HIBER=$repo/target/release/hiber
    [ -x "$HIBER" ] || HIBER=$repo/target/debug/hiber
fi
# The system's python3, which has python3-protobuf and python3-yaml (zdtm.py needs both),
# whatever else PATH holds first.
python=/usr/bin/python3
sys_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# Tests that install seccomp filters of their own and check the whole stack: hiber's
# io_uring filter (`hiber run` keeps jobs off io_uring) would be one more there, so they run
# as a user who knows that runs them: with `--allow-io-uring`.
allow_io_uring="seccomp_filter_threads seccomp_strict"

log() { printf '[zdtm] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

modes=baseline,criu,stop,leave
results=
list_only=0
names=()
while [ $# -gt 0 ]; do
    case $1 in
        --modes) modes=${2:?--modes needs a list}; shift 2 ;;
        --modes=*) modes=${1#--modes=}; shift ;;
        --results) results=${2:?--results needs a file}; shift 2 ;;
        --results=*) results=${1#--results=}; shift ;;
        --list) list_only=1; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) names+=("$1"); shift ;;
    esac
done
for m in ${modes//,/ }; do
    case $m in baseline | criu | stop | leave) ;; *) die "unknown mode $m (baseline, criu, stop, leave)" ;; esac
done
want() { [[ ",$modes," == *",$1,"* ]]; }

[ "$(id -u)" -eq 0 ] || die "needs root (CRIU does)"
[ -f "$tarball" ] || die "no $tarball: run scripts/setup.sh first"
[ -x "$criu" ] || die "no CRIU at $criu: run scripts/setup.sh first"
if want stop || want leave; then
    [ -x "$HIBER" ] || die "no hiber binary at $HIBER: run scripts/setup.sh (or set HIBER)"
fi

# Non-`suid` tests switch to another uid (18943), and CRIU then needs CAP_SYS_RESOURCE to
# read and set their rlimits. Where root lacks it (some containers), every test runs as root,
# as `suid` tests always do, for zdtm.py (through a line added to its copy) and for hiber alike.
cap_eff=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
if (((0x$cap_eff >> 24) & 1)); then as_root=0; else as_root=1; fi

# --- Building the tests (once; make is a no-op afterwards) ------------------------------

prepare() {
    local sum
    # zdtm.py needs PyYAML, which scripts/setup.sh does not install (hiber does not need it).
    if ! $python -c 'import yaml' 2>/dev/null; then
        log "installing python3-yaml (zdtm.py needs it)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-yaml >/dev/null
    fi
    sum=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [ "$(cat "$work/.tarball.sha256" 2>/dev/null)" != "$sum" ]; then
        log "extracting $(basename "$tarball") into $work"
        rm -rf "$src" "$work/.built" && mkdir -p "$work"
        tar -xf "$tarball" -C "$work"
        echo "$sum" >"$work/.tarball.sha256"
    fi
    mkdir -p "$work/logs" "$work/results" "$work/run"
    if [ ! -f "$work/.built" ]; then
        log "building zdtm's static tests (about a minute; make -j2, log in $work/build.log)"
        nice -n 10 make -C "$src/test/zdtm/lib" -j2 >"$work/build.log" 2>&1 || { tail -n 20 "$work/build.log" >&2; die "zdtm's library did not build"; }
        # A few tests need libraries CRIU itself does not (netns_sub_veth, libnl-route):
        # -k builds the others; those are left out below, as zdtm.py leaves out tests that
        # are not there.
        nice -n 10 make -k -C "$static" -j2 >>"$work/build.log" 2>&1 || log "some tests did not build (see $work/build.log); they are left out"
        make -C "$src/test" umount2 zdtm_ct >>"$work/build.log" 2>&1 || die "zdtm's helpers did not build (see $work/build.log)"
        build_pycriu
        touch "$work/.built"
    fi
    # zdtm.py runs a non-`suid` test as uid 18943; ZDTM_AS_ROOT=1 keeps it root (see above).
    if ! grep -q ZDTM_AS_ROOT "$src/test/zdtm.py"; then
        sed -i "s/^        if not test_flag(self.__desc, 'suid'):\$/        if not test_flag(self.__desc, 'suid') and os.environ.get('ZDTM_AS_ROOT') != '1':/" "$src/test/zdtm.py"
        grep -q ZDTM_AS_ROOT "$src/test/zdtm.py" || die "could not adapt zdtm.py (its suid line changed?)"
    fi
}

# zdtm.py imports pycriu, whose protobuf modules CRIU's build generates; this is that step
# alone (lib/pycriu/Makefile), without configuring the whole CRIU build.
build_pycriu() {
    local p=$src/lib/pycriu m f
    (cd "$src" && protoc -I=images/ -I=/usr/include/ --python_out="$p/images" $(ls images/*.proto | grep -v '^images/rpc.proto$'))
    (cd "$src" && protoc -I=images/ --python_out="$p" images/rpc.proto)
    (cd "$src" && $python scripts/magic-gen.py criu/include/magic.h "$p/images/magic.py")
    {
        echo "# Autogenerated. Do not edit!"
        for f in "$src"/images/*.proto; do
            m=$(basename "$f" .proto | tr - _)_pb2
            case $m in rpc_pb2 | opts_pb2) continue ;; esac
            echo "from .$m import *"
        done
    } >"$p/images/pb.py"
    echo "__version__ = '4.1.1'" >"$p/version.py"
    (cd "$src/test" && $python -c 'import pycriu') || die "pycriu does not import (python3-protobuf missing?)"
}

# --- Which tests apply -------------------------------------------------------------------

# Prints `NAME<TAB>apply<TAB>FLAGS<TAB>TIMEOUT` or `NAME<TAB>skip<TAB>REASON`, per test, with
# zdtm.py's own rules for a host-flavour run (its all_tests and run_tests).
classify() {
    (cd "$src/test" && PATH=$sys_path $python - "$criu" "$@") <<'PY'
import os, stat, subprocess, sys

criu, wanted = sys.argv[1], sys.argv[2:]
with open("zdtm.desc") as f:
    suite = eval(f.read())
excluded = {os.path.join(suite["dir"], x) for x in suite["exclude"]}
names = []
for f in sorted(os.listdir("zdtm/static")):
    p = os.path.join("zdtm/static", f)
    st = os.lstat(p)
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IXUSR:
        continue
    if f.endswith((".checkskip", ".hook")) or p in excluded:
        continue
    names.append(f)
if wanted:
    missing = [w for w in wanted if w not in names]
    for w in missing:
        print(f"{w}\tskip\tno such test (or it did not build)")
    names = [n for n in names if n in wanted]

features = {}
def have(feature):
    if feature not in features:
        features[feature] = subprocess.call([criu, "check", "--feature", feature], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
    return features[feature]

arch = os.uname()[4]
for n in names:
    d = f"zdtm/static/{n}.desc"
    desc = eval(open(d).read()) if os.path.exists(d) and os.path.getsize(d) > 0 else {}
    flags = desc.get("flags", "").split()
    reason = None
    if desc.get("arch", arch) != arch:
        reason = f"arch {desc['arch']}"
    elif "noauto" in flags and not wanted:
        reason = "noauto: zdtm runs it by hand only"
    elif any(not have(f) for f in desc.get("feature", "").split()):
        reason = "no CRIU feature " + " ".join(f for f in desc.get("feature", "").split() if not have(f))
    elif "h" not in desc.get("flavor", "h ns uns").split():
        reason = "ns/uns flavour only"
    elif os.access(f"zdtm/static/{n}.checkskip", os.X_OK) and subprocess.call([f"zdtm/static/{n}.checkskip"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) != 0:
        reason = "its checkskip says this machine lacks what it needs"
    if reason:
        print(f"{n}\tskip\t{reason}")
    else:
        print(f"{n}\tapply\t{','.join(flags) or '-'}\t{int(desc.get('timeout') or 30)}")
PY
}

# --- Running one test --------------------------------------------------------------------

out_file=
record() { # NAME MODE RESULT REASON
    local line="$1 $2 $3"
    case $3 in fail | skip) line="$1 $2 $3(${4:-})" ;; esac
    echo "$line"
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$out_file"
}

# The first line of its input, trimmed for a one-line reason; of hiber's stderr, the
# error's line, without its `hiber: `.
first_line() {
    local text
    text=$(cat)
    { grep -m 1 '^hiber: ' <<<"$text" || head -n 1 <<<"$text"; } | sed 's/^hiber: //' | cut -c1-240 | tr '\t' ' '
}

# CRIU locks TCP connections with iptables unless told otherwise, and fails every dump of
# one where the iptables program is missing (Debian's minimal images, this project's
# machines); hiber locks them with nftables there (criu/client.rs), and so does CRIU
# alone here, through a configuration file that zdtm.py's `--no-default-config` leaves
# alone (a test's own `--network-lock` still wins).
criu_conf=$work/criu-nftables.conf
if command -v iptables >/dev/null || PATH=$sys_path command -v iptables >/dev/null; then criu_conf=; fi

# zdtm.py's own run of one test: `baseline` without checkpoint (--nocr), `criu` with.
zdtm_py() { # NAME MODE TIMEOUT
    local name=$1 mode=$2 limit=$3 logf=$work/logs/$1.$2.log args=()
    [ "$mode" = baseline ] && args=(--nocr)
    (cd "$src/test" && env PATH=$sys_path ZDTM_AS_ROOT=$as_root ${criu_conf:+CRIU_CONFIG_FILE=$criu_conf} timeout -k 10 $((limit * 4 + 60)) \
        ./zdtm.py run -t "zdtm/static/$name" -f h --criu-bin "$criu" --keep-img never "${args[@]}") >"$logf" 2>&1
    local rc=$?
    # Without a checkpoint zdtm.py fails a `crfail` test (one CRIU must refuse) for
    # "unexpected success", once the test itself passed: here that is its pass.
    if grep -q "Test zdtm/static/$name PASS" "$logf" ||
        { [ "$mode" = baseline ] && grep -q "Test zdtm/static/$name FAIL at unexpected success" "$logf"; }; then
        rm -f "$logf"
        return 0
    fi
    local why
    why=$(grep -o "FAIL at .* #" "$logf" | head -n 1 | sed 's/ #*$//')
    [ "$rc" -eq 124 ] && why="zdtm.py timed out"
    echo "${why:-zdtm.py exited with $rc}; log $logf"
    return 1
}

# PID (in this namespace) of the process whose PID in the PID namespace of `root` is `nspid`.
host_pid() { # ROOT NSPID
    local ns p
    ns=$(readlink "/proc/$1/ns/pid" 2>/dev/null) || return 1
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/pid" 2>/dev/null)" = "$ns" ] || continue
        if [ "$(awk '/^NSpid:/ {print $NF}' "$p/status" 2>/dev/null)" = "$2" ]; then
            echo "${p#/proc/}"
            return 0
        fi
    done
    return 1
}

job_pid() { # JOB
    "$HIBER" ls --json | $python -c 'import json, sys; print(next((j["pid"] for j in json.load(sys.stdin)["jobs"] if j["name"] == sys.argv[1]), ""))' "$1"
}

# Whether PID is gone or a zombie (a finished test stays one: the job's init, `sleep`,
# reaps nothing).
ended() { [ ! -e "/proc/$1" ] || [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" = Z ]; }

wait_until() { # SECONDS COMMAND...
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        [ $SECONDS -lt $deadline ] || return 1
        sleep 0.1
    done
}

# The test's zdtm hook, where it has one, as zdtm.py runs it: from test/, and in mount and
# PID namespaces of its own (zdtm.py runs in such), so that nothing it mounts or starts (the
# net_lock hooks start servers) stays on the machine once it returns.
run_hook() { # NAME ARG ...
    local h=zdtm/static/$1.hook
    [ -x "$src/test/$h" ] || return 0
    shift
    (cd "$src/test" && PATH=$sys_path ZDTM_TEST_PID=$hook_pid ZDTM_IMG_DIR=$hook_imgs \
        unshare --mount --propagation slave --pid --fork "$h" "$@") >>"$work/logs/$name.$mode.hooks.log" 2>&1
}

# Tells the test at host PID to finish and prints its verdict: `PASS`, or why not.
finish() { # PID LIMIT
    local pid=$1 limit=$2 last
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_until "$limit" ended "$pid"; then
        echo "no verdict $limit s after SIGTERM (it hangs)"
        return
    fi
    # The test renames NAME.out.inprogress to NAME.out at exit (the second of two copies
    # finds it renamed and writes on into NAME.out); zdtm reads PASS on its last line.
    last=$(tail -n 1 "$static/$name.out" 2>/dev/null || true)
    if grep -qw PASS <<<"$last"; then
        echo PASS
    elif [ -n "$last" ]; then
        echo "$last" | sed 's/^[0-9:.]* *[0-9]*: //' | first_line
    else
        local code
        code=$(awk '{print $NF}' "/proc/$pid/stat" 2>/dev/null || true)
        echo "ended without a verdict${code:+ (wait status $code)}"
    fi
}

# A test as a hiber job: MODE `stop` or `leave`.
hiber_mode() { # NAME MODE FLAGS LIMIT
    local name=$1 mode=$2 flags=$3 limit=$4
    # Job names take letters, digits, '.', '_' and '-' (unlink_fstat01+ has a '+').
    local job=zdtm-${name//[^A-Za-z0-9._-]/_}
    local copy=$job-copy img=$work/run/$name.img rc_file=$work/run/$name.start-rc
    local cmd opts=() env_vars=() pid nspid root verdict err note=
    hook_pid=0 hook_imgs=$work/run/$name.imgs
    rm -rf "$img" "$hook_imgs" "$rc_file" "$work/logs/$name.$mode."*
    mkdir -p "$hook_imgs/1"
    "$HIBER" rm -f "$job" "$copy" >/dev/null 2>&1 || true
    make -s -C "$static" "$name.cleanout" >/dev/null 2>&1 || true
    cmd=$(cd "$static" && make -s -n --no-print-directory "$name.pid" 2>/dev/null | grep '^\./' | head -n 1 || true)
    [ -n "$cmd" ] || { record "$name" "$mode" skip "no start rule in its Makefile"; return; }
    [[ " $allow_io_uring " == *" $name "* ]] && opts+=(--allow-io-uring) && note="run with --allow-io-uring"
    env_vars=(TMPDIR="${TMPDIR:-/tmp}" ZDTM_THREAD_BOMB=5)
    if [ "$as_root" = 0 ] && [[ ",$flags," != *,suid,* ]]; then
        env_vars+=(ZDTM_UID=18943 ZDTM_GID=58467 "ZDTM_GROUPS=27495 48244")
        chmod a+w "$static"
    fi
    # The test daemonizes: its first process exits once the test runs, which would end
    # the job (its PID namespace) with it; a shell that then becomes `sleep` holds it.
    if ! err=$("$HIBER" run --name "$job" "${opts[@]}" -- env "${env_vars[@]}" sh -c \
        "cd '$static' && $cmd; echo \$? >'$rc_file'; exec sleep infinity" 2>&1 >/dev/null); then
        record "$name" "$mode" fail "hiber run: $(first_line <<<"$err")"
        return
    fi
    # As zdtm.py does, while the test starts: some wait for what this hook sets up.
    run_hook "$name" --post-start
    if ! wait_until "$limit" test -s "$rc_file" || [ "$(cat "$rc_file")" != 0 ]; then
        local said
        said=$(cat "$static/$name.out.inprogress" "$static/$name.out" 2>/dev/null | grep -m 1 -E 'ERR|FAIL' |
            sed 's/^[0-9:.]* *[0-9]*: //')
        [ -n "$said" ] || said=$("$HIBER" logs "$job" 2>&1 | grep . | tail -n 1)
        if [ -s "$rc_file" ]; then
            record "$name" "$mode" fail "its start failed in the job (exit $(cat "$rc_file"))${said:+: $said}"
        else
            record "$name" "$mode" fail "did not start within $limit s in the job${said:+: $said}"
        fi
        cleanup_job
        return
    fi
    nspid=$(cat "$static/$name.pid")
    root=$(job_pid "$job")
    pid=$(host_pid "$root" "$nspid") || { record "$name" "$mode" fail "test process $nspid not found in job $job"; cleanup_job; return; }
    hook_pid=$pid
    run_hook "$name" --pre-dump

    local ck=(checkpoint "$job" --out "$img")
    [ "$mode" = leave ] && ck+=(--leave-running)
    if ! hiber_cmd dump "${ck[@]}"; then
        if [[ ",$flags," == *,crfail,* ]]; then
            # CRIU must refuse this one (zdtm's crfail): the original goes on and passes.
            verdict=$(finish "$pid" "$limit")
            if [ "$verdict" = PASS ]; then
                record "$name" "$mode" pass "refused, as CRIU does (crfail): $(first_line <<<"$err")"
            else
                record "$name" "$mode" fail "refused as expected (crfail), then the original: $verdict"
            fi
        else
            record "$name" "$mode" fail "checkpoint: $(first_line <<<"$err")"
            keep_criu_log "$err" dump
        fi
        cleanup_job
        return
    fi
    [[ ",$flags," == *,crfail,* ]] && note="${note:+$note; }checkpointed, where CRIU alone refuses (crfail)"

    run_hook "$name" --pre-restore
    local rs=(restore "$img" --name "$copy")
    [ "$mode" = leave ] && rs+=(--isolate-net)
    if ! hiber_cmd restore "${rs[@]}"; then
        record "$name" "$mode" fail "restore: $(first_line <<<"$err")"
        keep_criu_log "$err" restore
        [ "$mode" = leave ] && finish "$pid" "$limit" >/dev/null
        cleanup_job
        return
    fi
    local copy_pid
    copy_pid=$(host_pid "$(job_pid "$copy")" "$nspid") || { record "$name" "$mode" fail "restored, but test process $nspid not found in job $copy"; cleanup_job; return; }
    hook_pid=$copy_pid
    run_hook "$name" --post-restore

    verdict=$(finish "$copy_pid" "$limit")
    if [ "$mode" = leave ]; then
        local original
        original=$(finish "$pid" "$limit")
        if [ "$verdict" = PASS ] && [ "$original" = PASS ]; then
            record "$name" "$mode" pass "$note"
        elif [ "$verdict" = PASS ] && [[ $original == *"No such file or directory"* ]]; then
            record "$name" "$mode" fail "the original, after its copy passed and removed the files they share: $original"
        elif [ "$verdict" = PASS ]; then
            record "$name" "$mode" fail "the original, after its copy passed: $original"
        else
            record "$name" "$mode" fail "the copy: $verdict${original:+; the original: $original}"
        fi
    elif [ "$verdict" = PASS ]; then
        record "$name" "$mode" pass "$note"
    else
        record "$name" "$mode" fail "after restore: $verdict"
    fi
    cleanup_job
}

# How long a checkpoint or a restore of one zdtm test may take: they take well under a
# second, and CRIU can wait for good (a copy's flock(2) on a lock its original holds).
hiber_limit=60

# Runs `hiber ARGS...` (a checkpoint, whose CRIU log is `dump.log`, or a restore) for at
# most $hiber_limit seconds; its stderr, or why it did not return, is left in $err.
hiber_cmd() { # dump|restore ARGS...
    local what=$1 rc log
    shift
    err=$(timeout -k 10 "$hiber_limit" "$HIBER" "$@" 2>&1 >/dev/null)
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        log=$(ls -td "$HIBER_STATE/logs/$what"-* 2>/dev/null | head -n 1)/$what.log
        err="hiber $1 did not return within $hiber_limit s
hint: CRIU's log: $log"
    fi
    return "$rc"
}

# Keeps the CRIU log that hiber's error names (`CRIU's log: PATH`), and hiber's stderr.
keep_criu_log() { # STDERR WHAT
    local path
    printf '%s\n' "$1" >"$work/logs/$name.$mode.$2.hiber.log"
    path=$(grep -o "CRIU's log: .*" <<<"$1" | head -n 1 | cut -d' ' -f3-)
    [ -n "$path" ] && cp "$path" "$work/logs/$name.$mode.$2.log" 2>/dev/null
    return 0
}

cleanup_job() { # (uses hiber_mode's $job and $copy)
    local j
    for j in "$HIBER_STATE/jobs/$job" "$HIBER_STATE/jobs/$copy"; do
        [ -d "$j" ] || continue
        # The jobs' logs, for a failure's second look.
        cat "$j/stdout.log" "$j/stderr.log" >>"$work/logs/$name.$mode.job.log" 2>/dev/null || true
    done
    "$HIBER" rm -f "$job" "$copy" >/dev/null 2>&1 || true
    rm -rf "$work/run/$name".*
    run_hook "$name" --clean
    make -s -C "$static" "$name.cleanout" >/dev/null 2>&1 || true
    find "$work/logs" -name "$name.$mode.*" -size 0 -delete 2>/dev/null || true
}

# --- Main --------------------------------------------------------------------------------

prepare
[ -n "$criu_conf" ] && echo "network-lock nftables" >"$criu_conf"
mapfile -t rows < <(classify "${names[@]}")
if [ "$list_only" = 1 ]; then
    printf '%s\n' "${rows[@]}" | awk -F'\t' '{ if ($2 == "apply") print $1; else print $1 "\tskip(" $3 ")" }'
    exit 0
fi

results=${results:-$work/results/$(date +%Y%m%d-%H%M%S).tsv}
mkdir -p "$(dirname "$results")"
out_file=$results
: >"$out_file"
log "$(grep -c $'\tapply' <<<"$(printf '%s\n' "${rows[@]}")") tests apply; modes $modes; results in $results"
[ "$as_root" = 1 ] && log "no CAP_SYS_RESOURCE here: every test runs as root (as zdtm's suid tests do)"
# Leftovers of an interrupted run.
for j in "$HIBER_STATE"/jobs/zdtm-*; do [ -d "$j" ] && "$HIBER" rm -f "$(basename "$j")" >/dev/null 2>&1; done
rm -rf "$work/run" && mkdir -p "$work/run"

# From here a failing step is a test's failure, recorded, never the script's end.
set +e
started=$SECONDS
for row in "${rows[@]}"; do
    IFS=$'\t' read -r name status flags limit <<<"$row"
    if [ "$status" = skip ]; then
        for m in ${modes//,/ }; do record "$name" "$m" skip "$flags"; done
        continue
    fi
    base_ok=1
    for mode in ${modes//,/ }; do
        if [ "$mode" != baseline ] && [ "$base_ok" = 0 ]; then
            record "$name" "$mode" skip "fails without any checkpoint"
            continue
        fi
        case $mode in
            baseline | criu)
                make -s -C "$static" "$name.cleanout" >/dev/null 2>&1 || true
                if why=$(zdtm_py "$name" "$mode" "$limit"); then
                    record "$name" "$mode" pass
                else
                    record "$name" "$mode" fail "$why"
                    [ "$mode" = baseline ] && base_ok=0
                fi
                make -s -C "$static" "$name.cleanout" >/dev/null 2>&1 || true
                ;;
            stop | leave) hiber_mode "$name" "$mode" "$flags" "$limit" ;;
        esac
    done
done

summary() {
    awk -F'\t' -v label="$1" -v mode="${2:-}" '
        mode == "" || $2 == mode { n[$3]++ }
        END { printf "%s%d passed, %d failed, %d skipped\n", label, n["pass"], n["fail"], n["skip"] }' "$out_file"
}
for m in ${modes//,/ }; do summary "  $m: " "$m"; done
summary ""
log "took $(((SECONDS - started) / 60)) min; results in $results"
awk -F'\t' '$3 == "fail" { bad = 1 } END { exit bad }' "$out_file"
