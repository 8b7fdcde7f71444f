//! Whole stacks from per-file unwind tables (issue #12), for real: programs built here
//! without frame pointers — a library of thousands of functions loaded with dlopen in the
//! middle of the run, frames larger than any stack copy — recorded and checked frame by
//! frame; tables built once per file and shared by processes; the disk cache used, and
//! rebuilt when an entry is damaged, of another version or not root's; the files a program
//! used loaded before it runs again; a library loaded deep in a stack larger than any copy
//! joined to the frames above it (anchors); code without call-frame information (a JIT's,
//! a library built without) walked by its frame pointer; memory bounded
//! under a flood; a short-lived process under `record -a` on a busy machine unwound whole.
mod common;

use std::{
    fmt::Write as _,
    fs,
    io::Write as _,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use common::*;
use serde_json::Value;

/// Compiles C `source` into `out` with `flags` (no frame pointers, as distributions build).
fn cc(dir: &Path, name: &str, source: &str, flags: &[&str]) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    fs::write(&src, source).unwrap();
    let out = dir.join(name);
    let status = Command::new("cc")
        .args(["-O2", "-g", "-fomit-frame-pointer", "-fno-builtin", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .args(flags)
        .status()
        .expect("running cc");
    assert!(status.success(), "compiling {name}");
    out
}

/// A library of `n` functions (big enough to matter); two chains of ten through it end in
/// `big_leaf_a` (malloc(100)) and `big_leaf_b` (malloc(200)); `big_run(rounds)` runs both
/// `rounds` times and frees the blocks of chain a.
fn big_library(dir: &Path, n: usize) -> PathBuf {
    let mut c = String::from(
        "#include <stdlib.h>\n#define NOIPA __attribute__((noipa))\nvolatile unsigned long big_sink;\n\
         NOIPA void *big_leaf_a(void) { void *p = malloc(100); big_sink += (unsigned long)p; return p; }\n\
         NOIPA void *big_leaf_b(void) { void *p = malloc(200); big_sink += (unsigned long)p; return p; }\n",
    );
    for i in (0..n).rev() {
        // Each function has its own frame size; chain a is big_f0..big_f9, chain b
        // big_f100..big_f109; the rest are there to make the file large.
        let next = match i {
            9 => "big_leaf_a()".to_string(),
            109 => "big_leaf_b()".to_string(),
            _ if i < 9 || (100..109).contains(&i) => format!("big_f{}(d + 1)", i + 1),
            _ => "0".to_string(),
        };
        writeln!(
            c,
            "NOIPA void *big_f{i}(int d) {{ volatile char pad[{}]; pad[d % sizeof pad] = (char)d; void *p = {next}; \
             big_sink += pad[0] + (unsigned long)p; return p; }}",
            16 + (i % 13) * 8
        )
        .unwrap();
    }
    c.push_str(
        "NOIPA void big_run(int rounds) { for (int r = 0; r < rounds; r++) { free(big_f0(0)); \
         big_sink += (unsigned long)big_f100(0); } }\n",
    );
    cc(dir, "libbig.so", &c, &["-shared", "-fPIC"])
}

const HOST: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    usleep(150 * 1000); /* running well before the library is loaded */
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    void (*run)(int) = (void (*)(int))dlsym(lib, "big_run");
    /* argv[3], if given: microseconds between rounds. */
    int pace = argc > 3 ? atoi(argv[3]) : 0;
    if (!pace) run(atoi(argv[2]));
    for (int r = 0; pace && r < atoi(argv[2]); r++) { run(1); usleep(pace); }
    return 0;
}
"#;

/// `main` with 9.6 KiB of locals allocates 50 × 32 bytes itself and, through
/// `deep_frame` (64 KiB of locals), 100 × 64 bytes in `alloc_site`.
const FRAMES: &str = r#"
#include <stdlib.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long sink;
NOIPA void *alloc_site(void) { void *p = malloc(64); sink += (unsigned long)p; return p; }
NOIPA void deep_frame(int n) {
    volatile char huge[65536];
    huge[n % sizeof huge] = (char)n;
    for (int i = 0; i < n; i++) { void *p = alloc_site(); sink += (unsigned long)p + huge[i]; free(p); }
}
int main(void) {
    volatile char big[9600];
    big[sizeof big - 1] = 1;
    for (int i = 0; i < 50; i++) { void *p = malloc(32); sink += (unsigned long)p + big[i]; free(p); }
    deep_frame(100);
    return big[sizeof big - 1] - 1;
}
"#;

/// A program as most are: modest frames (the window before a new program's table is
/// ready is covered by stack copies, which reach 16 KiB up the stack).
fn small_frames() -> String {
    FRAMES.replace("huge[65536]", "huge[2048]").replace("big[9600]", "big[1024]")
}

fn functions(site: &Value) -> Vec<String> {
    site["frames"].as_array().unwrap().iter().map(|f| f["function"].as_str().unwrap_or("").to_string()).collect()
}

/// The user sites of `report` (grouped by stack) whose innermost frame is `name`.
fn sites_of<'a>(report: &'a Value, name: &str) -> Vec<&'a Value> {
    report["sites"].as_array().unwrap().iter().filter(|s| s["frames"][0]["function"] == name).collect()
}

fn record(data: &Path, env: &[(&str, &str)], args: &[&str], cmd: &[&Path]) -> String {
    let mut c = memtrace();
    for (k, v) in env {
        c.env(k, v);
    }
    let out =
        run(c.args(["record", "--no-kernel", "-o"]).arg(data).args(args).arg("--").args(cmd).stdout(Stdio::null()));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_big_library_loaded_mid_run_has_whole_stacks() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("big-library");
    let lib = big_library(&dir, 3000);
    let host = cc(&dir, "host", HOST, &["-ldl"]);
    let data = dir.join("big.data");
    let cache = dir.join("cache");
    let out = run(memtrace()
        .env("MEMTRACE_CACHE_DIR", &cache)
        .env("MEMTRACE_LOG", "debug")
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(&host)
        .arg(&lib)
        .arg("300"));
    // Built mid-run, the library's table (~100 KiB) went into a map installed ahead of
    // need: in the probes without waiting for a grace period.
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.lines().any(|l| l.contains("libbig.so: its unwind table written into a map installed ahead")), "{log}");
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    for (leaf, size, chain) in [("big_leaf_a", 100, 0), ("big_leaf_b", 200, 100)] {
        let sites = sites_of(&report, leaf);
        assert_eq!(sites.len(), 1, "{leaf}: one stack, one row: {sites:#?}");
        let site = sites[0];
        assert_eq!(site["allocs"], 300, "{leaf}");
        assert_eq!(site["bytes_req"], 300 * size, "{leaf}");
        assert_eq!(site["truncated"], false, "{leaf}: no stack cut short");
        let mut want = vec![leaf.to_string()];
        want.extend((chain..chain + 10).rev().map(|i| format!("big_f{i}")));
        want.extend(["big_run", "main"].map(String::from));
        let got = functions(site);
        assert_eq!(&got[..want.len()], &want[..], "{leaf}: {got:?}");
        assert!(got.iter().any(|f| f.contains("__libc_start")), "{leaf}: reaches the start: {got:?}");
    }
    assert_eq!(report["stacks"]["user"]["allocs_truncated"], 0, "{:#}", report["stacks"]);
}

#[test]
fn a_library_a_program_loaded_last_time_is_ready_before_it_loads_it_again() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("companions");
    let lib = big_library(&dir, 2000);
    let host = cc(&dir, "host", HOST, &["-ldl"]);
    let cache = dir.join("cache");
    let env = [("MEMTRACE_CACHE_DIR", cache.to_str().unwrap()), ("MEMTRACE_LOG", "debug")];
    let first = dir.join("first.data");
    record(&first, &env, &["-q"], &[&host, &lib, Path::new("200")]);
    // The second run loads the library's table before the program starts, so the probes
    // install its mapping themselves at the dlopen: not one stack waits for a table.
    let second = dir.join("second.data");
    let log = record(&second, &env, &["-q"], &[&host, &lib, Path::new("200")]);
    assert!(log.contains("loading the tables of"), "{log}");
    let report = report_json(&second, &["--by", "stack", "--domain", "user"]);
    assert_eq!(report["recorder"]["unwind_copies"], 0, "{:#}", report["recorder"]);
    assert_eq!(report["recorder"]["unwind_tables"]["built"], 0, "{:#}", report["recorder"]);
    for leaf in ["big_leaf_a", "big_leaf_b"] {
        let sites = sites_of(&report, leaf);
        assert_eq!(sites.len(), 1, "{leaf}: {sites:#?}");
        assert_eq!((sites[0]["allocs"].as_u64(), sites[0]["truncated"].as_bool()), (Some(200), Some(false)));
        assert!(functions(sites[0]).iter().any(|f| f.contains("__libc_start")), "{leaf}");
    }
}

#[test]
fn frames_larger_than_any_copy_unwind_whole() {
    assert_frames_unwind_whole("big-frames", FRAMES);
}

/// A frame past 512 KiB (rustc's `run_compiler` closure keeps 527 KiB of locals): its
/// CFA offset is kept in 8-byte words in the table's row.
#[test]
fn a_frame_of_600_kib_unwinds_whole() {
    assert_frames_unwind_whole("huge-frame", &FRAMES.replace("huge[65536]", "huge[600 * 1024]"));
}

/// Records `source` (FRAMES, with other sizes) and asserts that both its sites have whole
/// stacks, one row each.
fn assert_frames_unwind_whole(name: &str, source: &str) {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch(name);
    let prog = cc(&dir, "frames", source, &[]);
    let data = dir.join("frames.data");
    record(&data, &[("MEMTRACE_CACHE_DIR", dir.join("cache").to_str().unwrap())], &["-q"], &[&prog]);
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let deep = sites_of(&report, "alloc_site");
    assert_eq!(deep.len(), 1, "one row for the site: {deep:#?}");
    assert_eq!(deep[0]["allocs"], 100);
    assert_eq!(deep[0]["truncated"], false);
    assert_eq!(&functions(deep[0])[..3], ["alloc_site", "deep_frame", "main"]);
    let main_sites: Vec<&Value> = sites_of(&report, "main").into_iter().filter(|s| s["bytes_req"] == 50 * 32).collect();
    assert_eq!(main_sites.len(), 1, "one row for main's own site");
    assert_eq!(main_sites[0]["allocs"], 50);
    assert_eq!(main_sites[0]["truncated"], false);
}

/// `descend` recurses 60 frames of ~0.5 KiB (a stack of ~34 KiB, deeper than any copy),
/// allocates there (a whole walk), loads the library given and runs its `deep_run`, whose
/// 50 allocations come before its table can be ready.
const DEEP_HOST: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long sink;
NOIPA void descend(int depth, const char *path) {
    volatile char pad[512];
    pad[depth % sizeof pad] = (char)depth;
    if (depth > 0) { descend(depth - 1, path); sink += pad[0]; return; }
    void *p = malloc(24); sink += (unsigned long)p; free(p);
    void *lib = dlopen(path, RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); exit(2); }
    void (*run)(int) = (void (*)(int))dlsym(lib, "deep_run");
    run(50);
    sink += 1; /* not a tail call: the frame stays */
}
int main(int argc, char **argv) { descend(60, argv[1]); return 0; }
"#;

const DEEP_LIB: &str = r#"
#include <stdlib.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long deep_sink;
NOIPA void *deep_leaf(void) { void *p = malloc(48); deep_sink += (unsigned long)p; return p; }
NOIPA void *deep_mid(int i) { volatile char pad[64]; pad[i % 64] = 1; void *p = deep_leaf(); deep_sink += pad[0]; return p; }
NOIPA void deep_run(int n) { for (int i = 0; i < n; i++) free(deep_mid(i)); }
"#;

/// Records `cmd` into `data` (a fresh unwind cache each time) and reports its user stacks,
/// up to four times until `taken` says the recorder's figures show the path under test:
/// a library's allocations coming before its table is ready. On a busy machine the
/// program can be off its CPU long enough for the table to be ready first.
fn record_until_copies(dir: &Path, data: &Path, cmd: &[&Path], taken: impl Fn(&Value) -> bool) -> Value {
    let mut report = Value::Null;
    for attempt in 0..4 {
        let cache = dir.join(format!("cache{attempt}"));
        record(data, &[("MEMTRACE_CACHE_DIR", cache.to_str().unwrap())], &["-q"], cmd);
        report = report_json(data, &["--by", "stack", "--domain", "user"]);
        if taken(&report["recorder"]) {
            break;
        }
    }
    report
}

/// Asserts the one stack of `DEEP_LIB`'s 50 allocations is whole: `deep_leaf`, `deep_mid`,
/// `deep_run`, the host's `under` frames, 61 `descend`, `main`. Returns its functions and
/// how many of them were checked.
fn assert_deep_leaf_whole(report: &Value, under: &[&str]) -> (Vec<String>, usize) {
    let sites = sites_of(report, "deep_leaf");
    assert_eq!(sites.len(), 1, "one stack, one row: {sites:#?}");
    assert_eq!((sites[0]["allocs"].as_u64(), sites[0]["truncated"].as_bool()), (Some(50), Some(false)));
    let got = functions(sites[0]);
    let mut want = vec!["deep_leaf", "deep_mid", "deep_run"];
    want.extend_from_slice(under);
    want.extend(std::iter::repeat_n("descend", 61));
    want.push("main");
    assert_eq!(&got[..want.len()], &want[..], "{got:?}");
    let n = want.len();
    (got, n)
}

#[test]
fn a_library_loaded_deep_in_a_stack_deeper_than_a_copy_unwinds_whole() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("deep-dlopen");
    let lib = cc(&dir, "libdeep.so", DEEP_LIB, &["-shared", "-fPIC"]);
    let host = cc(&dir, "deephost", DEEP_HOST, &["-ldl"]);
    // The library's allocations come before its table: the probes walk on from a frame of
    // the thread's earlier whole walk, and userspace joins the gap.
    let report = record_until_copies(&dir, &dir.join("deep.data"), &[&host, &lib], |recorder| {
        recorder["unwind_copies_anchored"].as_u64().unwrap() >= 1
    });
    let recorder = &report["recorder"];
    assert!(recorder["unwind_copies_anchored"].as_u64().unwrap() >= 1, "{recorder:#}");
    let (got, n) = assert_deep_leaf_whole(&report, &[]);
    assert!(got[n..].iter().any(|f| f.contains("__libc_start")), "reaches the start: {got:?}");
}

/// Without the disk cache, a big table built here is read back from the probes' own array
/// (mapped only while used) rather than kept in memtrace's heap: the copies taken before
/// the library's table was ready are finished from it, whole.
#[test]
fn without_the_cache_copies_are_finished_from_the_probes_arrays() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("deep-dlopen-no-cache");
    // `DEEP_LIB` and 5,000 functions more: a table over the 64 KiB read back (~80 KiB).
    let mut source = String::from(DEEP_LIB);
    for i in 0..5000 {
        writeln!(
            source,
            "NOIPA long deep_fill{i}(long x) {{ volatile char pad[{}]; pad[0] = (char)x; return x * {} + pad[0]; }}",
            16 + i % 64,
            i + 3
        )
        .unwrap();
    }
    let lib = cc(&dir, "libdeep.so", &source, &["-shared", "-fPIC"]);
    let host = cc(&dir, "deephost", DEEP_HOST, &["-ldl"]);
    let data = dir.join("deep.data");
    let (mut report, mut log) = (Value::Null, String::new());
    for _ in 0..4 {
        log = record(&data, &[("MEMTRACE_LOG", "debug")], &["-q", "--no-unwind-cache"], &[&host, &lib]);
        report = report_json(&data, &["--by", "stack", "--domain", "user"]);
        if report["recorder"]["unwind_copies_anchored"].as_u64().unwrap() >= 1 {
            break;
        }
    }
    assert!(report["recorder"]["unwind_copies_anchored"].as_u64().unwrap() >= 1, "{:#}", report["recorder"]);
    assert!(
        log.lines().any(|l| l.contains("libdeep.so: read from the probes' array from now on")),
        "the library's table is read from the probes' array: {log}"
    );
    let (got, n) = assert_deep_leaf_whole(&report, &[]);
    assert!(got[n..].iter().any(|f| f.contains("__libc_start")), "reaches the start: {got:?}");
}

/// As `DEEP_HOST`, but the thread's last whole walk before the library's allocations
/// went three frames deeper (`stale_a` → `stale_b` → `stale_c` → malloc) than the
/// function that then calls into the library, `big_frame`, whose unwritten locals keep
/// those frames' return addresses in their slots: three stale anchors in a row.
const STALE_HOST: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long sink;
void *kept;
NOIPA void *stale_c(void) { void *p = malloc(24); sink += (unsigned long)p; return p; }
NOIPA void *stale_b(void) { volatile char pad[32]; pad[0] = 1; void *p = stale_c(); sink += pad[0]; return p; }
NOIPA void *stale_a(void) { volatile char pad[32]; pad[0] = 1; void *p = stale_b(); sink += pad[0]; return p; }
NOIPA void big_frame(void (*run)(int)) {
    volatile char locals[2048]; /* only the lowest byte written: the stale frames stay */
    locals[0] = 0;
    run(50);
    sink += locals[0];
}
NOIPA void descend(int depth, const char *path) {
    volatile char pad[512];
    pad[depth % sizeof pad] = (char)depth;
    if (depth > 0) { descend(depth - 1, path); sink += pad[0]; return; }
    void *lib = dlopen(path, RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); exit(2); }
    void (*run)(int) = (void (*)(int))dlsym(lib, "deep_run");
    kept = stale_a();
    big_frame(run);
    free(kept);
    sink += 1;
}
int main(int argc, char **argv) { descend(60, argv[1]); return 0; }
"#;

#[test]
fn a_library_called_under_several_stale_anchors_unwinds_whole() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("stale-anchors");
    let lib = cc(&dir, "libdeep.so", DEEP_LIB, &["-shared", "-fPIC"]);
    let host = cc(&dir, "stalehost", STALE_HOST, &["-ldl"]);
    // Until a copy had anchors, landed or not.
    let report = record_until_copies(&dir, &dir.join("stale.data"), &[&host, &lib], |recorder| {
        recorder["unwind_copies_anchored"].as_u64().unwrap() + recorder["unwind_copies_anchor_missed"].as_u64().unwrap()
            >= 1
    });
    let recorder = &report["recorder"];
    // With the stack pointers of only the first two frames from the anchor, every copy
    // missed (its walk of the gap passed them both, then ran out of copy).
    assert!(recorder["unwind_copies_anchored"].as_u64().unwrap() >= 1, "{recorder:#}");
    assert_eq!(recorder["unwind_copies_anchor_missed"], 0, "{recorder:#}");
    assert_deep_leaf_whole(&report, &["big_frame"]);
}

/// As `DEEP_HOST`, but the library is called under `big_frame`, whose 20 KiB of locals
/// (every byte written, so no stale frame stays in them) put the nearest frame of the
/// thread's earlier whole walk further above the library's allocations than an unanchored
/// copy reaches (16 KiB), as Cython's module initializers (16.5 KiB of locals) do while a
/// package's extension modules load.
const WIDE_HOST: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long sink;
NOIPA void big_frame(void (*run)(int)) {
    volatile char locals[20480];
    for (unsigned i = 0; i < sizeof locals; i++) locals[i] = (char)i;
    run(50);
    sink += locals[100];
}
NOIPA void descend(int depth, const char *path) {
    volatile char pad[512];
    pad[depth % sizeof pad] = (char)depth;
    if (depth > 0) { descend(depth - 1, path); sink += pad[0]; return; }
    void *p = malloc(24); sink += (unsigned long)p; free(p);
    void *lib = dlopen(path, RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); exit(2); }
    big_frame((void (*)(int))dlsym(lib, "deep_run"));
    sink += 1;
}
int main(int argc, char **argv) { descend(60, argv[1]); return 0; }
"#;

#[test]
fn a_library_called_under_a_frame_larger_than_a_copy_unwinds_whole() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("wide-frame");
    let lib = cc(&dir, "libdeep.so", DEEP_LIB, &["-shared", "-fPIC"]);
    let host = cc(&dir, "widehost", WIDE_HOST, &["-ldl"]);
    // The copy covers the whole gap below the anchor, 20 KiB and more: before, an anchor
    // that far up was not taken, the copy stopped at 16 KiB and every stack was cut there.
    let report = record_until_copies(&dir, &dir.join("wide.data"), &[&host, &lib], |recorder| {
        recorder["unwind_copies_anchored"].as_u64().unwrap() >= 1
    });
    let recorder = &report["recorder"];
    assert!(recorder["unwind_copies_anchored"].as_u64().unwrap() >= 1, "{recorder:#}");
    assert_deep_leaf_whole(&report, &["big_frame"]);
}

/// A library built without call-frame information (with frame pointers, as some are).
const NO_CFI_LIB: &str = r#"
#define NOIPA __attribute__((noipa))
volatile unsigned long nocfi_sink;
NOIPA void *nocfi_mid(void *(*f)(void)) { void *p = f(); nocfi_sink += (unsigned long)p; return p; }
"#;

/// Allocations under code no call-frame information describes: a function of that library,
/// and "JIT-compiled" code (a stub that keeps a frame pointer, in memory made executable
/// by `mprotect` as JITs commit their code: node's V8 does both), which the program names
/// in its perf map (`/tmp/perf-PID.map`), as JITs do; its pid goes to the file `argv[1]`.
const NO_CFI_HOST: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long sink;
void *nocfi_mid(void *(*f)(void));
NOIPA void *fp_leaf(void) { void *p = malloc(40); sink += (unsigned long)p; return p; }
NOIPA void through_library(int n) { for (int i = 0; i < n; i++) free(nocfi_mid(fp_leaf)); sink += 1; }
NOIPA void through_jit(int n) {
    /* push %rbp; mov %rsp,%rbp; call *%rdi; pop %rbp; ret */
    static const unsigned char code[] = {0x55, 0x48, 0x89, 0xe5, 0xff, 0xd7, 0x5d, 0xc3};
    unsigned char *m = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memcpy(m, code, sizeof code);
    if (mprotect(m, 4096, PROT_READ | PROT_EXEC) != 0) exit(2);
    char path[64];
    snprintf(path, sizeof path, "/tmp/perf-%d.map", (int)getpid());
    FILE *map = fopen(path, "w");
    if (!map) exit(3);
    fprintf(map, "%lx %zx jit_stub\n", (unsigned long)m, sizeof code);
    fclose(map);
    void *(*jit)(void *(*)(void)) = (void *(*)(void *(*)(void)))m;
    for (int i = 0; i < n; i++) free(jit(fp_leaf));
    sink += 1;
}
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "w");
    if (!f) return 4;
    fprintf(f, "%d\n", (int)getpid());
    fclose(f);
    through_library(30);
    through_jit(40);
    return 0;
}
"#;

#[test]
fn code_without_call_frame_information_is_walked_by_its_frame_pointer() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("no-cfi");
    let no_unwind_tables = ["-shared", "-fPIC", "-g0", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"];
    let lib = cc(&dir, "libnocfi.so", NO_CFI_LIB, &[&no_unwind_tables[..], &["-fno-omit-frame-pointer"]].concat());
    let rpath = format!("-Wl,-rpath,{}", dir.display());
    let host = cc(&dir, "nocfihost", NO_CFI_HOST, &[lib.to_str().unwrap(), &rpath]);
    let data = dir.join("nocfi.data");
    let pid_file = dir.join("pid");
    record(&data, &[("MEMTRACE_CACHE_DIR", dir.join("cache").to_str().unwrap())], &["-q"], &[&host, &pid_file]);
    let pid = fs::read_to_string(&pid_file).unwrap();
    let _ = fs::remove_file(format!("/tmp/perf-{}.map", pid.trim()));
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let sites = sites_of(&report, "fp_leaf");
    assert_eq!(sites.len(), 2, "one stack for each way: {sites:#?}");
    for site in sites {
        let got = functions(site);
        let (allocs, caller) = match site["allocs"].as_u64() {
            Some(30) => (30, "through_library"),
            Some(40) => (40, "through_jit"),
            other => panic!("{other:?}: {got:?}"),
        };
        assert_eq!(site["truncated"].as_bool(), Some(false), "{allocs}: {got:?}");
        // The JIT's frame is named from the program's perf map.
        let middle = if allocs == 30 { "nocfi_mid" } else { "jit_stub" };
        assert_eq!(&got[..4], &["fp_leaf", middle, caller, "main"], "{got:?}");
        assert!(got[4..].iter().any(|f| f.contains("__libc_start")), "reaches the start: {got:?}");
    }
}

#[test]
fn processes_of_one_program_share_its_table_and_the_cache_serves_the_next_run() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("shared-tables");
    let prog = cc(&dir, "frames", &small_frames(), &[]);
    let cache = dir.join("cache");
    let cache_env = cache.to_str().unwrap();
    let script = format!("{0}; {0}", prog.display());
    let sh = Path::new("/bin/sh");
    let data = dir.join("twice.data");
    let mut c = memtrace();
    let out = run(c
        .env("MEMTRACE_CACHE_DIR", cache_env)
        .env("MEMTRACE_LOG", "debug")
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::null()));
    let log = String::from_utf8_lossy(&out.stderr);
    let builds = log.lines().filter(|l| l.contains("unwind table of") && l.contains("/frames:")).count();
    assert_eq!(builds, 1, "the program's table is built once for both processes:\n{log}");
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let deep = sites_of(&report, "alloc_site");
    assert_eq!(deep.len(), 2, "a row per process (two pids)");
    for site in deep {
        assert_eq!((site["allocs"].as_u64(), site["truncated"].as_bool()), (Some(100), Some(false)));
    }
    let _ = sh;

    // A second run finds every table in the cache.
    let data2 = dir.join("again.data");
    record(&data2, &[("MEMTRACE_CACHE_DIR", cache_env)], &["-q"], &[&prog]);
    let tables = &report_json(&data2, &[])["recorder"]["unwind_tables"];
    assert_eq!(tables["built"], 0, "{tables:#}");
    assert!(tables["from_cache"].as_u64().unwrap() >= 3, "{tables:#}");
}

/// Damages every entry of the cache three ways, one each: a flipped byte, another format
/// version, another owner.
fn damage_cache(cache: &Path) -> usize {
    let mut entries: Vec<PathBuf> = fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tbl"))
        .collect();
    entries.sort();
    assert!(entries.len() >= 3, "{entries:?}");
    for (i, path) in entries.iter().take(3).enumerate() {
        let mut bytes = fs::read(path).unwrap();
        match i {
            0 => {
                let last = bytes.len() - 1;
                bytes[last] ^= 0x55;
                fs::write(path, &bytes).unwrap();
            }
            1 => {
                bytes[8..12].copy_from_slice(&999u32.to_le_bytes());
                fs::write(path, &bytes).unwrap();
            }
            _ => {
                let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: chown of a file this test owns.
                assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
                fs::set_permissions(path, fs::Permissions::from_mode(0o600)).unwrap();
            }
        }
    }
    3
}

#[test]
fn damaged_stale_or_foreign_cache_entries_are_rebuilt() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("cache-damage");
    let prog = cc(&dir, "frames", FRAMES, &[]);
    let cache = dir.join("cache");
    let env = [("MEMTRACE_CACHE_DIR", cache.to_str().unwrap()), ("MEMTRACE_LOG", "debug")];
    record(&dir.join("first.data"), &env, &["-q"], &[&prog]);
    let damaged = damage_cache(&cache);
    let data = dir.join("second.data");
    let log = record(&data, &env, &["-q"], &[&prog]);
    for reason in ["checksum does not match", "format version 999", "owned by uid 65534"] {
        assert!(log.contains(reason), "the log names why an entry is rebuilt ({reason}):\n{log}");
    }
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    assert_eq!(report["recorder"]["unwind_tables"]["built"], damaged as u64, "{:#}", report["recorder"]);
    assert_eq!(sites_of(&report, "alloc_site")[0]["truncated"], false);
    // Rebuilt entries are good again.
    let log = record(&dir.join("third.data"), &env, &["-q"], &[&prog]);
    assert!(!log.contains("rebuilding"), "{log}");
}

#[test]
fn a_flood_through_tiny_rings_stays_bounded_and_readable() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("flood");
    let data = dir.join("flood.data");
    run(memtrace()
        .args(["record", "-q", "--ring-size", "16K", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--loop-seconds", "2", "--loop-threads", "2"])
        .stdout(Stdio::null()));
    let report = report_json(&data, &[]);
    assert!(report["lost_events"].as_u64().unwrap() > 0, "the flood overflowed the rings: {:#}", report["lost_events"]);
    let rss = report["recorder"]["peak_rss_bytes"].as_u64().unwrap();
    assert!(rss < 256 << 20, "memtrace's memory stayed bounded: {rss} bytes");
    assert!(report["totals"]["user"]["allocs"].as_u64().unwrap() > 0);
}

/// Stacks cut short because a ring had no room for the copy that would have finished them
/// are told from the other causes: counted in the summary (each copy the probes refused is
/// one allocation on such a stack), and named alone in the process's warning. Before, the
/// warning named both causes with the session's count, whatever cut the process's stacks.
/// Rings of 16 KiB never have room for a copy (a copy needs over 16 KiB, and a ring keeps a
/// quarter free); a big library loaded mid-run is walked by copies until its table is built.
#[test]
fn stacks_cut_for_want_of_ring_room_are_told_apart() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("no-room");
    let lib = big_library(&dir, 3000);
    let host = cc(&dir, "host", HOST, &["-ldl"]);
    let data = dir.join("no-room.data");
    let mut report = Value::Null;
    for attempt in 0..4 {
        // A cold cache each time: the library's table is built while it runs.
        run(memtrace()
            .env("MEMTRACE_CACHE_DIR", dir.join(format!("cache{attempt}")))
            .args(["record", "-q", "--force", "--no-kernel", "--ring-size", "16K", "-o"])
            .arg(&data)
            .arg("--")
            .arg(&host)
            .arg(&lib)
            .args(["300", "500"]));
        report = report_json(&data, &[]);
        if report["recorder"]["unwind_budget_truncated"].as_u64().unwrap() > 0 {
            break;
        }
    }
    let refused = report["recorder"]["unwind_budget_truncated"].as_u64().unwrap();
    assert!(refused > 0, "no copy refused in 4 runs: {:#}", report["recorder"]);
    let user = &report["stacks"]["user"];
    let no_room = user["allocs_no_room"].as_u64().unwrap();
    eprintln!("copies refused: {refused}; events lost: {}; {user}", report["lost_events"]);
    assert!(no_room > 0 && no_room <= user["allocs_truncated"].as_u64().unwrap(), "{user}");
    if report["lost_events"] == 0 {
        assert_eq!(no_room, refused, "{user}");
    } else {
        assert!(no_room <= refused, "{user}");
    }
    let text = String::from_utf8(run(memtrace().args(["report", "-i"]).arg(&data)).stdout).unwrap();
    assert!(text.contains(&format!("{no_room} for want of ring room for a stack copy")), "{text}");
    // Every file here has unwind information: the host's warning, where it has one, names
    // the ring alone.
    for warning in report["warnings"].as_array().unwrap().iter().filter_map(|w| w.as_str()) {
        if warning.contains("have a stack cut short") && user["allocs_truncated"] == no_room {
            assert!(warning.contains("the rings had no room") && !warning.contains("without unwind"), "{warning}");
        }
    }
}

/// A busy loop on every core, until dropped.
struct Hogs(Vec<Child>);

impl Hogs {
    fn start() -> Self {
        let n = thread::available_parallelism().map_or(2, |n| n.get());
        Self((0..n).map(|_| Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap()).collect())
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_short_lived_process_under_record_all_on_a_busy_machine_unwinds_whole() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("busy-all");
    let prog = cc(&dir, "frames", &small_frames(), &[]);
    let data = dir.join("all.data");
    let _hogs = Hogs::start();
    let (mut recorder, stderr) = start_record_all(&data, &["--no-kernel", "-d", "4s"]);
    thread::sleep(Duration::from_millis(300));
    let child = Command::new(&prog).status().unwrap();
    assert!(child.success());
    assert!(recorder.wait().unwrap().success(), "{}", stderr.join().unwrap());
    let report = report_json(&data, &["--by", "stack", "--domain", "user", "--comm", "frames"]);
    let deep = sites_of(&report, "alloc_site");
    assert_eq!(deep.len(), 1, "{:#}", report["sites"]);
    assert_eq!(deep[0]["allocs"], 100);
    assert_eq!(deep[0]["truncated"], false, "whole, though the process lived for milliseconds");
    assert_eq!(&functions(deep[0])[..3], ["alloc_site", "deep_frame", "main"], "and symbolized");
}

/// Many processes of a program new to memtrace (python3, with no table built: the cache
/// unused), started at once on a machine kept busy by a CPU hog per core: until the
/// program's table is built, each allocation in its code sends a stack copy, and a drain
/// with no more of the CPUs than each hog let the rings fill and refuse copies (0.9–38 %
/// of their stacks cut short). memtrace drains and builds at a lower niceness than the
/// load (`--nice`, −10 by default), while the commands it starts keep the caller's.
#[test]
fn new_processes_started_at_once_on_a_busy_machine_keep_whole_stacks() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("busy-many");
    let data = dir.join("all.data");
    let _hogs = Hogs::start();
    let (mut recorder, stderr) = start_record_all(&data, &["--no-kernel", "--no-unwind-cache", "-d", "5s"]);
    thread::sleep(Duration::from_millis(300));
    let n = 4 * thread::available_parallelism().map_or(2, |n| n.get());
    let pythons: Vec<Child> =
        (0..n).map(|_| Command::new("python3").args(["-c", "import json, decimal"]).spawn().unwrap()).collect();
    for mut p in pythons {
        assert!(p.wait().unwrap().success());
    }
    assert!(recorder.wait().unwrap().success(), "{}", stderr.join().unwrap());
    let report = report_json(&data, &["--domain", "user", "--comm", "python3"]);
    let user = &report["stacks"]["user"];
    eprintln!("{user}");
    let with_stack = user["allocs_with_stack"].as_u64().unwrap();
    assert!(with_stack > 1000 * n as u64, "{user}");
    // None for want of ring room (the load's cause); 0.08 % for others in one CI run of a
    // 2-core machine (24 of 30,592), within the issue's 1 %.
    assert_eq!(user["allocs_no_room"], 0, "{user}");
    assert!(user["allocs_truncated"].as_u64().unwrap() * 200 <= with_stack, "over 0.5 % cut short: {user}");
    // The interpreter is described to the probes in time too: 88 % of the allocations
    // have a Python frame (the rest are start-up's), 15–43 % at the load's niceness.
    assert!(
        user["allocs_with_python"].as_u64().unwrap() * 4 > user["allocs_with_stack"].as_u64().unwrap() * 3,
        "{user}"
    );
}

/// Forks `argv[1]` children from its second CPU, one after another; each moves to the first
/// and execs this program again, which makes `argv[2]` allocations and exits. The fork
/// record is in the second CPU's ring, the child's exec in the first's, which the reader
/// reads first: when both wait in the rings (a reader busy with the earlier children's
/// events), the exec is read before the fork.
const FORKER: &str = r#"
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>
__attribute__((noinline)) void child_loop(int n) {
    for (int i = 0; i < n; i++) free(malloc(64 + i % 100));
}
int main(int argc, char **argv) {
    if (argc == 2) { child_loop(atoi(argv[1])); return 0; }
    /* The first two CPUs this process may use: the parent on the second, the children
       on the first (its ring is read first). */
    cpu_set_t allowed, cpu;
    int first = -1, second = -1;
    sched_getaffinity(0, sizeof allowed, &allowed);
    for (int c = 0; c < CPU_SETSIZE && second < 0; c++)
        if (CPU_ISSET(c, &allowed)) { if (first < 0) first = c; else second = c; }
    if (second < 0) return 2;
    CPU_ZERO(&cpu); CPU_SET(second, &cpu);
    if (sched_setaffinity(0, sizeof cpu, &cpu)) return 3;
    for (int i = 0, n = atoi(argv[1]); i < n; i++) {
        pid_t p = fork();
        if (p == 0) {
            CPU_ZERO(&cpu); CPU_SET(first, &cpu);
            if (sched_setaffinity(0, sizeof cpu, &cpu)) _exit(3);
            execl("/proc/self/exe", argv[0], argv[2], (char *)0);
            _exit(127);
        }
        waitpid(p, 0, 0);
    }
    return 0;
}
"#;

/// A child's exec read before its parent's fork (from another CPU's ring) must not leave
/// the child in its parent's address space: the late fork took the exec's ranges out of
/// the probes for the child's whole life, and every one of its stacks became a copy (a
/// whole sqlite3 process of 685,000 allocations, 3× memtrace's CPU; some cut short; here
/// 66,000 of 180,000 before the fix). With the cache warm, every table is in the probes
/// before each child's exec: not one copy.
#[test]
fn a_fork_read_after_the_childs_exec_leaves_the_child_in_its_new_space() {
    require_root();
    let _alone = alone_on_the_machine();
    if thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: the race needs two CPUs");
        return;
    }
    let dir = scratch("late-fork");
    let prog = cc(&dir, "forker", FORKER, &[]);
    let cache = dir.join("cache");
    let env = [("MEMTRACE_CACHE_DIR", cache.to_str().unwrap())];
    record(&dir.join("cold.data"), &env, &["-q"], &[&prog, Path::new("2"), Path::new("10")]);
    let (children, allocs) = (60, 3000);
    let data = dir.join("warm.data");
    record(&data, &env, &["-q"], &[&prog, Path::new(&children.to_string()), Path::new(&allocs.to_string())]);
    let report = report_json(&data, &["--by", "site", "--domain", "user"]);
    let recorder = &report["recorder"];
    assert_eq!(recorder["unwind_tables"]["built"], 0, "{recorder:#}");
    assert_eq!(recorder["unwind_copies"], 0, "every child's code in the probes: {recorder:#}");
    let site = sites_of(&report, "child_loop");
    assert_eq!(site.len(), 1, "{:#}", report["sites"]);
    assert_eq!(site[0]["allocs"], children * allocs);
    assert_eq!(site[0]["truncated"], false);
    // Records the drain's time order did not catch (a fork read in a later drain than the
    // child's exec) are refused by the address spaces (unit-tested in `spaces`).
    let late = recorder["unwind_late_task_records"].as_u64().unwrap();
    eprintln!("task records read late: {late}");
}

/// Runs before tracing begins: allocates 30 blocks, waits for a line on its input, then
/// forks (on its first CPU, whose ring is read first; the child moves to the second: its
/// stacks may be read in the drain before the one that reads the fork). The
/// child frees the 30 blocks, allocates 100 times through `child_work`, and execs
/// `/bin/true`. The parent prints the child's pid, and lives on a little.
const SUBSHELL: &str = r#"
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>
#define NOIPA __attribute__((noipa))
void *before[30];
volatile unsigned long sink;
NOIPA void child_leaf(int i) {
    char *p = malloc(1000 + i);
    sink += (unsigned long)p;
    free(p);
}
NOIPA void child_work(void) {
    for (int i = 0; i < 100; i++) child_leaf(i);
}
int main(void) {
    for (int i = 0; i < 30; i++) before[i] = malloc(48);
    cpu_set_t allowed, cpu;
    int first = -1, second = -1;
    sched_getaffinity(0, sizeof allowed, &allowed);
    for (int c = 0; c < CPU_SETSIZE && second < 0; c++)
        if (CPU_ISSET(c, &allowed)) { if (first < 0) first = c; else second = c; }
    if (second >= 0) { CPU_ZERO(&cpu); CPU_SET(first, &cpu); sched_setaffinity(0, sizeof cpu, &cpu); }
    char line[8];
    if (!fgets(line, sizeof line, stdin)) return 1;
    pid_t p = fork();
    if (p == 0) {
        if (second >= 0) { CPU_ZERO(&cpu); CPU_SET(second, &cpu); sched_setaffinity(0, sizeof cpu, &cpu); }
        for (int i = 0; i < 30; i++) free(before[i]);
        child_work();
        execl("/bin/true", "true", (char *)0);
        _exit(127);
    }
    printf("%d\n", p);
    fflush(stdout);
    waitpid(p, 0, 0);
    /* A shell outlives its subshells: its maps are read when its child's fork is. */
    usleep(500 * 1000);
    return 0;
}
"#;

/// Under `-a`, the child of a process running before tracing began (a shell's subshell)
/// runs its parent's code until it execs: its stacks are walked in its parent's files and
/// named there, even when read before its fork or after its exec (before: every one cut
/// short at its first frame, `[unknown]`), and what it frees of its parent's blocks from
/// before tracing is inherited, not unmatched (before: 30 frees without allocation, and a
/// warning blaming a late probe).
#[test]
fn a_child_of_a_process_running_before_record_all_unwinds_in_its_parents_code() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("subshell");
    let prog = cc(&dir, "subshell", SUBSHELL, &[]);
    let data = dir.join("all.data");
    let mut parent = Command::new(&prog).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let (mut recorder, stderr) = start_record_all(&data, &["--no-kernel", "-d", "3s"]);
    thread::sleep(Duration::from_millis(300));
    parent.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let out = parent.wait_with_output().unwrap();
    assert!(out.status.success());
    let child = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(recorder.wait().unwrap().success(), "{}", stderr.join().unwrap());
    let report = report_json(&data, &["--by", "stack", "--domain", "user", "--pid", &child]);
    let site = sites_of(&report, "child_leaf");
    assert_eq!(site.len(), 1, "{:#}", report["sites"]);
    assert_eq!((&site[0]["allocs"], &site[0]["frees"]), (&100.into(), &100.into()));
    assert_eq!(site[0]["truncated"], false);
    assert_eq!(&functions(site[0])[..3], ["child_leaf", "child_work", "main"]);
    let user = &report["totals"]["user"];
    assert_eq!((&user["inherited_frees"], &user["unmatched_frees"]), (&30.into(), &0.into()), "{user:#}");
}

/// Starts `shell` (running before tracing began; it waits for a line on its input), then
/// `record -a` with `args` into `data`; once tracing, lets the shell go, and waits for both.
fn record_all_around(shell: &mut Command, data: &Path, args: &[&str]) {
    record_all_around_held(shell, data, args, false);
}

/// `record_all_around`, the recorder held (SIGSTOP) from before the shell's line until the
/// shell has exited when `held`: the probes go on, but nothing of the shell is read, so no
/// table of it can be ready before it forks (the case a busy machine makes at random).
fn record_all_around_held(shell: &mut Command, data: &Path, args: &[&str], held: bool) {
    let mut shell = shell.stdin(Stdio::piped()).spawn().unwrap();
    let (mut recorder, stderr) = start_record_all(data, args);
    thread::sleep(Duration::from_millis(300));
    if held {
        signal(recorder.id(), libc::SIGSTOP);
    }
    shell.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let ended = shell.wait().unwrap();
    if held {
        signal(recorder.id(), libc::SIGCONT);
    }
    assert!(ended.success());
    assert!(recorder.wait().unwrap().success(), "{}", stderr.join().unwrap());
}

/// The same with a real shell (helper-35): bash, running before tracing began, forks `ls`
/// (allocating in bash's code before the exec). The shell is not known to the probes: each
/// of its kernel allocations in the fork sends a stack copy, full size under a big
/// environment (a login shell's), and those fill its ring's share of a drain before the
/// fork record. That record is read a drain after the child's exec, and so are the copies
/// the child took before its exec on another CPU: they were walked in the exec's space or
/// in what the child's `/proc` showed (`ls`), and its first stacks read `[unknown]`, cut
/// short (17 of 256 allocations in 2 runs of 3 before). They now wait for the fork. The
/// mapping records of `ls`'s libraries came behind those copies, more than the 3 drains a
/// walked stack waited for its ranges: every libc frame of one `ls` was `[unknown]` (a CI
/// run; 1 run of 15 here). Such a stack now waits for a drain that reads the rings dry.
#[test]
fn a_shells_child_under_record_all_has_its_stacks_before_the_exec_in_bash() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("bash-child");
    let data = dir.join("all.data");
    let mut shell = Command::new("bash");
    shell.args(["-c", "read line; ls / > /dev/null; ls /usr > /dev/null; sleep 0.3"]).env("BIG", "x".repeat(60_000));
    // Rings of 64 MiB a CPU on 2 CPUs: under the big environment each copy is 16 KiB (~1,900
    // copies, 26 MB through the rings in this test when each kernel allocation of a
    // syscall sent its own: 119 from one `fork` of bash); on a busy 2-core machine a 16 MiB
    // ring filled in 1 run of 30 and 23 of ls's 242 allocations were cut for want of room
    // (counted and told apart below; what this test is about is where they are walked).
    // (128 MiB in all, at least 16 MiB a CPU: what a many-CPU runner can lock.)
    let cpus = thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let ring = ((128u64 << 20) / cpus).next_power_of_two().max(16 << 20);
    let ring = format!("{}K", ring >> 10);
    // Held: bash's table may otherwise be ready before its first fork (it was in 2 runs of
    // 14 while memtrace also looked into every library mapped for allocators), and then no
    // copy is sent at all.
    record_all_around_held(shell.stdout(Stdio::null()), &data, &["-d", "2s", "--ring-size", &ring], true);
    let processes = report_json(&data, &["--by", "process", "--domain", "user"]);
    // bash's `fork`s and the children's `execve`s allocate in the kernel again and again
    // under one syscall, each time from the same user registers: the copy the first sends
    // finishes the others (each sent its own 16 KiB copy before).
    let recorder = &processes["recorder"];
    assert!(recorder["unwind_copy_repeats"].as_u64().unwrap() > 0, "{recorder:#}");
    assert_eq!(recorder["unwind_copy_repeats_unmatched"], 0, "{recorder:#}");
    let children: Vec<&str> = processes["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["process"].as_str()?.strip_prefix("ls [")?.strip_suffix(']'))
        .collect();
    assert_eq!(children.len(), 2, "{:#}", processes["sites"]);
    for child in children {
        let report = report_json(&data, &["--by", "stack", "--domain", "user", "--pid", child]);
        let sites = report["sites"].as_array().unwrap();
        let in_bash: Vec<&Value> =
            sites.iter().filter(|s| s["frames"].as_array().unwrap().iter().any(|f| f["module"] == "bash")).collect();
        assert!(!in_bash.is_empty(), "pid {child}: no stack in bash's code before its exec: {sites:#?}");
        // Whole stacks: 17 of 256 allocations were cut before; a CI run of a busy 2-core
        // machine once cut ls's own reallocarray (2 of ~256) inside ls, after its exec.
        let allocs = |cut: bool| -> u64 {
            sites.iter().filter(|s| !cut || s["truncated"] == true).map(|s| s["allocs"].as_u64().unwrap()).sum()
        };
        // Cut for want of ring room is counted apart (the summary says so and how many);
        // any other cut is a walk gone wrong.
        let no_room = report["stacks"]["user"]["allocs_no_room"].as_u64().unwrap_or(0);
        assert!(
            allocs(true).saturating_sub(no_room) * 100 <= allocs(false),
            "pid {child}: over 1 % cut short ({no_room} for want of ring room): {sites:#?}"
        );
        for site in sites {
            // (bash's static functions are named `bash+0x…`, in its file: known.)
            let unplaced = site["frames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["module"].as_str().is_none_or(|m| m == "[unknown]"));
            assert!(!unplaced, "pid {child}: {site:#}");
        }
    }
}

/// A short program exec'd by a relative name (`./relprog`, from a directory that is not
/// memtrace's) under `record -a`, loading its plugin by a relative name too: it is gone
/// before its exec is read, and the names meant nothing from memtrace's directory, so every
/// one of its stacks was cut short at a first frame `[unknown] 0x…` (100 % of them in each
/// run). The probes now send the files' absolute paths, walked up from the kernel's own.
#[test]
fn a_program_and_a_library_opened_by_relative_names_under_record_all_are_named() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("relative-all");
    plug_library(&dir);
    cc(
        &dir,
        "relprog",
        "#include <dlfcn.h>\n#include <stdlib.h>\n\
         __attribute__((noinline)) void *alloc_site(size_t n) { return malloc(n); }\n\
         int main(void) {\n\
           for (int i = 0; i < 50; i++) free(alloc_site(64));\n\
           void *h = dlopen(\"./libplug.so\", RTLD_NOW);\n\
           if (!h) return 1;\n\
           ((void (*)(int))dlsym(h, \"plug_run\"))(30);\n\
           return 0;\n\
         }\n",
        &["-ldl", "-fno-optimize-sibling-calls"],
    );
    let data = dir.join("all.data");
    let (mut recorder, stderr) = start_record_all(&data, &["--no-kernel", "-d", "3s"]);
    thread::sleep(Duration::from_millis(300));
    assert_ne!(std::env::current_dir().unwrap(), *dir, "memtrace runs in another directory");
    assert!(Command::new("./relprog").current_dir(&*dir).status().unwrap().success());
    assert!(recorder.wait().unwrap().success(), "{}", stderr.join().unwrap());
    let report = report_json(&data, &["--by", "stack", "--domain", "user", "--comm", "relprog"]);
    for (site, allocs, callers) in
        [("alloc_site", 50, &["alloc_site", "main"][..]), ("plug_site", 30, &["plug_site", "plug_run", "main"][..])]
    {
        let found = sites_of(&report, site);
        assert_eq!(found.len(), 1, "{site}: {:#}", report["sites"]);
        assert_eq!(found[0]["allocs"], allocs, "{site}");
        assert_eq!(found[0]["truncated"], false, "{site}: whole, though the process lived for milliseconds");
        assert_eq!(&functions(found[0])[..callers.len()], callers, "{site}: and symbolized");
    }
    assert_eq!(report["stacks"]["user"]["allocs_truncated"], 0, "{:#}", report["stacks"]);
}

/// `libplug.so`: `plug_run(n)` allocates 96 bytes `n` times at `plug_site` and frees them.
fn plug_library(dir: &Path) -> PathBuf {
    cc(
        dir,
        "libplug.so",
        "#include <stdlib.h>\n\
         __attribute__((noinline)) void *plug_site(size_t n) { return malloc(n); }\n\
         void plug_run(int n) { for (int i = 0; i < n; i++) free(plug_site(96)); }\n",
        &["-shared", "-fPIC", "-fno-optimize-sibling-calls"],
    )
}

/// A process running before `record -a` began loads a library with dlopen, the reader held
/// behind the probes meanwhile: the library's mapping record is read before anything made
/// the process known. It was dropped (no space of the process to put it in), and the
/// process then learned from the session's snapshot, taken before the library was there:
/// every stack through the library was cut short at its first frame in it. The process is
/// now learned at that record, and the library added to what the snapshot showed.
#[test]
fn a_library_loaded_by_a_process_running_before_record_all_is_walked() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("dlopen-before-all");
    let plug = plug_library(&dir);
    let prog = cc(
        &dir,
        "waitprog",
        "#include <dlfcn.h>\n#include <unistd.h>\n\
         int main(int argc, char **argv) {\n\
           char line[16];\n\
           if (argc < 2 || read(0, line, sizeof line) < 0) return 1;\n\
           void *h = dlopen(argv[1], RTLD_NOW);\n\
           if (!h) return 1;\n\
           ((void (*)(int))dlsym(h, \"plug_run\"))(30);\n\
           return 0;\n\
         }\n",
        &["-ldl", "-fno-optimize-sibling-calls"],
    );
    let mut child = Command::new(&prog).arg(&plug).stdin(Stdio::piped()).spawn().unwrap();
    let data = dir.join("all.data");
    let (mut recorder, stderr) = start_record_all(&data, &["--no-kernel", "-d", "3s"]);
    thread::sleep(Duration::from_millis(300));
    signal(recorder.id(), libc::SIGSTOP);
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let ended = child.wait().unwrap();
    signal(recorder.id(), libc::SIGCONT);
    assert!(ended.success());
    assert!(recorder.wait().unwrap().success(), "{}", stderr.join().unwrap());
    let report = report_json(&data, &["--by", "stack", "--domain", "user", "--pid", &child.id().to_string()]);
    let found = sites_of(&report, "plug_site");
    assert_eq!(found.len(), 1, "{:#}", report["sites"]);
    assert_eq!(found[0]["allocs"], 30);
    assert_eq!(found[0]["truncated"], false, "{:#}", found[0]);
    assert_eq!(&functions(found[0])[..3], ["plug_site", "plug_run", "main"]);
}

/// Under `-a`, a process that execs twice in quick succession (`env bash -c …`, as every
/// `#!/usr/bin/env` script does): by the time its first exec is handled, `/proc` shows the
/// second program. env's frames were named with bash's file at env's offsets
/// (`__GI_setlocale ← bash+0x2f4cd … main (bash)` for env's `setlocale` call; 6 of 12
/// processes in a run, helper-36). The program is now the file whose code spans what the
/// kernel mapped at the exec.
#[test]
fn a_program_exec_replaced_at_once_is_named_in_its_own_file() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("env-exec");
    let data = dir.join("all.data");
    // From a shell running before tracing began (not known to the probes at its forks).
    let mut shell = Command::new("bash");
    shell.args(["-c", "read line; for i in $(seq 12); do /usr/bin/env bash -c 'sleep 0.1; true'; done"]);
    record_all_around(&mut shell, &data, &["--no-kernel", "-d", "4s"]);
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let (mut in_env, mut in_bash) = (0, 0);
    for site in report["sites"].as_array().unwrap() {
        let frames = site["frames"].as_array().unwrap();
        let Some(at) = frames.iter().position(|f| f["function"] == "__GI_setlocale") else { continue };
        let Some(caller) = frames.get(at + 1) else { continue };
        match caller["module"].as_str() {
            Some("env") => in_env += 1,
            // bash calls it from its locale functions, under more of its own; env from its
            // `main`, right above libc's start: such a stack with a bash frame is env's code
            // named in bash's file.
            Some("bash") => {
                assert_eq!(frames[at + 2]["module"], "bash", "{site:#}");
                in_bash += 1;
            }
            _ => {}
        }
    }
    assert!(in_env > 0 && in_bash > 0, "env's and bash's setlocale calls: {in_env} and {in_bash}");
}

/// A library whose `lib_mid` keeps a frame of `PAD` bytes: built with 4096 and with 8192,
/// the two have the same code at the same offsets (the frame's size is a 32-bit immediate
/// either way), and different rules at `lib_mid`'s return address.
const PADDED_LIBRARY: &str = r#"
#include <stdlib.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long sink;
NOIPA void *lib_leaf(int n) {
    void *p = malloc(n);
    sink += (unsigned long)p;
    return p;
}
NOIPA void *lib_mid(int n) {
    volatile char pad[PAD];
    pad[n & (PAD - 1)] = 1;
    void *p = lib_leaf(n);
    sink += pad[(n + 1) & (PAD - 1)];
    return p;
}
NOIPA void *lib_run(int n) {
    void *p = lib_mid(n);
    sink += 1; /* not a tail call */
    return p;
}
"#;

/// Loads `argv[1]`, waits for its table, allocates 200 times through it, unloads it; then
/// the same with `argv[2]` (mapped where the first was); prints where each `lib_run` was.
/// On one CPU: one rule cache.
const RELOADER: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#define NOIPA __attribute__((noipa))
typedef void *(*run_t)(int);
NOIPA void *use(const char *path) {
    void *h = dlopen(path, RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); exit(2); }
    run_t run = (run_t)dlsym(h, "lib_run");
    usleep(300 * 1000); /* its table ready and in the probes */
    for (int i = 0; i < 200; i++) free(run(100 + i));
    dlclose(h);
    return (void *)run;
}
int main(int argc, char **argv) {
    cpu_set_t allowed, one;
    sched_getaffinity(0, sizeof allowed, &allowed);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed)) { CPU_ZERO(&one); CPU_SET(c, &one); sched_setaffinity(0, sizeof one, &one); break; }
    void *a = use(argv[1]);
    void *b = use(argv[2]);
    printf("%p %p\n", a, b);
    return 0;
}
"#;

/// A library unloaded and another loaded at its address in the same process: the rules the
/// probes cached per CPU for the first one's addresses are not used for the second's (they
/// are keyed by address and address space). Before, the second library's `lib_mid` was
/// walked with the first's frame size, and its stacks went astray.
#[test]
fn a_library_loaded_where_another_was_unloaded_is_not_walked_by_its_rules() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("reload");
    // (Stack-clash probes, on by default in some distributions' GCC, would lay the two
    // frames out differently.)
    let flags = |pad: &'static str| ["-shared", "-fPIC", "-fno-stack-clash-protection", pad];
    let small = cc(&dir, "libpad4k.so", PADDED_LIBRARY, &flags("-DPAD=4096"));
    let large = cc(&dir, "libpad8k.so", PADDED_LIBRARY, &flags("-DPAD=8192"));
    let prog = cc(&dir, "reloader", RELOADER, &["-ldl"]);
    let data = dir.join("reload.data");
    let out = run(memtrace()
        .env("MEMTRACE_CACHE_DIR", dir.join("cache"))
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .args([&prog, &small, &large]));
    let printed = String::from_utf8(out.stdout).unwrap();
    let places: Vec<&str> = printed.split_whitespace().collect();
    assert_eq!(places.len(), 2, "{printed}");
    assert_eq!(places[0], places[1], "the second library must be mapped where the first was");
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let leaves = sites_of(&report, "lib_leaf");
    assert_eq!(leaves.iter().map(|s| s["allocs"].as_u64().unwrap()).sum::<u64>(), 400, "{leaves:#?}");
    for site in leaves {
        assert_eq!(site["truncated"], false, "{site:#}");
        assert_eq!(&functions(site)[..5], ["lib_leaf", "lib_mid", "lib_run", "use", "main"], "{site:#}");
    }
}
