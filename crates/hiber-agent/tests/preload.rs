//! The agent preloaded into programs that never touch a GPU (a shell, Python, the
//! dynamic loader's own lookups) on this machine, which has no GPU: the programs must
//! behave exactly as without it, and the agent must add no thread and no socket.

use std::path::PathBuf;
use std::process::Command;

fn agent() -> PathBuf {
    // The test is target/<profile>/deps/preload-HASH; cargo builds the cdylib into deps/
    // for tests, and copies it up a level for builds.
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let candidates = [deps.join("libhiber_agent.so"), deps.parent().unwrap().join("libhiber_agent.so")];
    let lib = candidates.iter().find(|p| p.exists()).unwrap_or_else(|| panic!("the agent cdylib is built beside the tests: {candidates:?}"));
    lib.clone()
}

fn run(script: &str, preload: bool) -> (String, String) {
    let mut c = Command::new("sh");
    c.arg("-c").arg(script).env("HIBER_AGENT_TOKEN", "preloadtest").env_remove("LD_PRELOAD");
    if preload {
        c.env("LD_PRELOAD", agent());
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
    (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn a_program_without_cuda_is_untouched() {
    // Threads of the shell itself, its view of its environment, a pipeline of children.
    let script = "ls /proc/$$/task | wc -l; echo $HIBER_AGENT_TOKEN; printf 'b\\na\\n' | sort | tr -d '\\n'; echo; grep -c preloadtest /proc/net/unix || true";
    let (plain, plain_err) = run(script, false);
    let (with, with_err) = run(script, true);
    assert_eq!(with, plain, "same output with the agent preloaded");
    assert_eq!(with.lines().next(), Some("1"), "no thread added");
    assert_eq!(with.lines().last(), Some("0"), "no control socket without CUDA");
    assert_eq!(with_err, plain_err, "nothing written to stderr");
    assert!(with_err.is_empty());
}

#[test]
fn dlsym_lookups_through_the_agent_match_the_loader() {
    // Python's ctypes resolves symbols with dlsym: with RTLD_DEFAULT, in a library handle,
    // and a missing one, through the agent's dlsym.
    let py = "import ctypes, ctypes.util; c = ctypes.CDLL(None); m = ctypes.CDLL(ctypes.util.find_library('m')); \
              print(c.getpid() > 0, hasattr(m, 'cos'), hasattr(c, 'no_such_symbol_xyz'))";
    let script = format!("command -v python3 >/dev/null && python3 -c \"{py}\" || echo 'True True False'");
    let (plain, _) = run(&script, false);
    let (with, err) = run(&script, true);
    assert_eq!(with, plain);
    assert_eq!(with.trim(), "True True False");
    assert!(err.is_empty(), "{err}");
}

#[test]
fn polls_through_the_agent_behave_as_glibc_s() {
    // The agent exports poll (to wake NCCL's proxy threads): Python's select.poll calls it,
    // with NCCL's 500 ms timeout among others.
    let py = "import select, os, time; r, w = os.pipe(); p = select.poll(); p.register(r, select.POLLIN); \
              t = time.time(); a = p.poll(500); d = time.time() - t; b = p.poll(0); os.write(w, b'x'); \
              c = p.poll(500); e = p.poll(-1); print(a, d >= 0.45, b, c == [(r, select.POLLIN)], c == e)";
    let script = format!("command -v python3 >/dev/null && python3 -c \"{py}\" || echo '[] True [] True True'");
    let (plain, _) = run(&script, false);
    let (with, err) = run(&script, true);
    assert_eq!(with, plain);
    assert_eq!(with.trim(), "[] True [] True True");
    assert!(err.is_empty(), "{err}");
}

/// A program that opens a library defining NCCL's names with `dlopen(RTLD_LOCAL)` and looks
/// them up with `dlsym` (XLA's NCCL stub does so with libnccl.so.2): with
/// the agent, a name the agent exports (every entry point that takes a communicator) is
/// answered with the agent's own, others with the library's; with `HIBER_NCCL_DLSYM=0`, and
/// without the agent, with the library's. The library here
/// is a stand-in compiled by the test (this machine has no NCCL); the GPU suite's
/// `agent_jax_sharded_two_gpus` runs JAX with the real one.
#[test]
fn nccl_looked_up_by_name_gets_the_agent_s_entry_points() {
    let dir = std::env::temp_dir().join(format!("hiber-agent-nccl-dlsym-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libnccl.so.2");
    let prog = dir.join("lookup");
    std::fs::write(dir.join("lib.c"), "int ncclCommCount(void *c, int *n) { *n = 42; return 0; }\nint ncclGetVersion(int *v) { *v = 22809; return 0; }\n")
        .unwrap();
    std::fs::write(
        dir.join("lookup.c"),
        r#"#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
static const char *where(void *p) { Dl_info i; return p && dladdr(p, &i) && i.dli_fname ? (strstr(i.dli_fname, "hiber_agent") ? "agent" : "library") : "none"; }
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    printf("ncclCommCount %s\nncclGetVersion %s\nncclNoSuchName %s\n", where(dlsym(h, "ncclCommCount")), where(dlsym(h, "ncclGetVersion")), where(dlsym(h, "ncclNoSuchName")));
    return 0;
}
"#,
    )
    .unwrap();
    for args in [
        vec!["-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", lib.to_str().unwrap(), dir.join("lib.c").to_str().unwrap()],
        vec!["-o", prog.to_str().unwrap(), dir.join("lookup.c").to_str().unwrap(), "-ldl"],
    ] {
        let st = Command::new("cc").args(&args).status().expect("run cc");
        assert!(st.success(), "cc {args:?}");
    }
    let script = format!("{} {}", prog.display(), lib.display());
    let library = "ncclCommCount library\nncclGetVersion library\nncclNoSuchName none\n";
    let (plain, _) = run(&script, false);
    assert_eq!(plain, library);
    // Turned off (HIBER_NCCL_DLSYM=0): the library's own, as without the agent.
    let (off, err) = run(&format!("HIBER_NCCL_DLSYM=0 {script}"), true);
    assert_eq!(off, library, "{err}");
    let (with, err) = run(&script, true);
    assert_eq!(with, "ncclCommCount agent\nncclGetVersion library\nncclNoSuchName none\n", "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
