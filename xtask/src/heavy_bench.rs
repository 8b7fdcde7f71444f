//! `cargo xtask bench heavy` (and part of `cargo xtask bench`): a heavy real program — a
//! Python script driving numpy, pandas and pyarrow (wheels of 10–60 MB without frame
//! pointers, from PyPI into a venv under target/bench) — bare, under heaptrack, under
//! memray, and under memtrace with a cold and a warm unwind cache and with frame pointers:
//! wall time, what each counted, how whole memtrace's stacks are, what it lost, its own CPU
//! and memory; then two Debian programs (sqlite3, GCC's cc1) bare, under heaptrack and
//! under memtrace. Figures from one session on one machine; nothing here passes or fails.
use std::{
    ffi::OsStr,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use crate::{build_release, target_dir};

/// This part's section of BENCHMARKS.md.
pub const SECTION: crate::Marked = crate::Marked {
    heading: "## Heavy programs: Python with big native wheels",
    begin: "<!-- heavy:begin -->",
    end: "<!-- heavy:end -->",
};

/// The wheels, as pip names them.
const WHEELS: &[&str] = &["numpy", "pandas", "pyarrow", "memray"];

/// Builds, joins and writes a few hundred thousand allocations' worth of data frames,
/// Arrow tables, Parquet and JSON.
pub const SCRIPT: &str = r#"import io, json, collections
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.compute as pc

rng = np.random.default_rng(7)
rows = 120_000
df = pd.DataFrame({
    "id": np.arange(rows),
    "x": rng.random(rows),
    "cat": [f"c{i % 997}" for i in range(rows)],
    "tag": rng.choice(["a", "b", "c", "d"], rows),
})
g = df.groupby(["cat", "tag"]).agg(n=("id", "count"), s=("x", "sum")).reset_index()
m = df.merge(g, on=["cat", "tag"], how="left")
t = pa.Table.from_pandas(m)
buf = io.BytesIO()
pq.write_table(t, buf, row_group_size=20_000)
t2 = pq.read_table(io.BytesIO(buf.getvalue()))
f = t2.filter(pc.greater(t2["x"], 0.5))
back = f.to_pandas()
recs = back.head(20_000).to_dict("records")
s = json.dumps(recs, default=str)
counts = collections.Counter(r["tag"] for r in json.loads(s))
print(len(back), len(g), sorted(counts.items())[:2])
"#;

/// A Debian program: the sqlite3 shell building, indexing, grouping, joining, sorting and
/// dumping a 200,000-row table in memory (libsqlite3 from Debian, no frame pointers).
pub const SQL: &str = "CREATE TABLE t(id INTEGER PRIMARY KEY, cat TEXT, x REAL, note TEXT);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
INSERT INTO t SELECT i, 'c' || (i % 997), (i * 7919 % 10007) / 10007.0,
  printf('%08x-%d', i * 2654435761 % 4294967296, i % 13) FROM n;
CREATE INDEX t_cat ON t(cat, x);
CREATE TABLE g AS SELECT cat, count(*) AS n, sum(x) AS s FROM t GROUP BY cat;
SELECT count(*), sum(length(note)) FROM t JOIN g USING (cat) WHERE x > 0.5;
SELECT cat, length(group_concat(id)) FROM (SELECT cat, id FROM t ORDER BY note LIMIT 50000)
  GROUP BY cat ORDER BY cat LIMIT 3;
SELECT json_group_array(json_object('id', id, 'cat', cat)) IS NOT NULL FROM (SELECT * FROM t WHERE id % 7 = 0);
";

/// The venv with the wheels (made once; pip is not run again when they import).
pub fn venv() -> Result<PathBuf> {
    let dir = target_dir().join("bench").join("venv");
    let python = dir.join("bin").join("python");
    let imports = "import numpy, pandas, pyarrow, memray";
    if python.exists() && Command::new(&python).args(["-c", imports]).status().is_ok_and(|s| s.success()) {
        return Ok(python);
    }
    eprintln!("xtask bench: creating {} with {}", dir.display(), WHEELS.join(", "));
    let ok = Command::new("python3").args(["-m", "venv"]).arg(&dir).status()?.success()
        && Command::new(&python).args(["-m", "pip", "install", "-q"]).args(WHEELS).status()?.success();
    if !ok {
        bail!("could not create the venv in {} (python3-venv and network access to PyPI are needed)", dir.display());
    }
    Ok(python)
}

struct Row {
    name: String,
    wall_s: f64,
    allocs: Option<u64>,
    /// memtrace only: its report.
    report: Option<serde_json::Value>,
    file_bytes: u64,
}

/// Rounds of runs: each round runs every tool and memtrace configuration once, in turn,
/// and the row shown is each one's median run. Alternating keeps the VM's drift (its
/// speed moves by tens of percent over minutes) out of the ratios between rows.
const RUNS: usize = 3;

/// One configuration of a table: its row's name and how to run it once.
type Config<'a> = (String, Box<dyn FnMut() -> Result<Row> + 'a>);

/// Runs `configs` in [`RUNS`] rounds, each once per round in the order given; returns each
/// configuration's runs, in round order.
fn rounds(configs: &mut [Config<'_>], part: &str) -> Result<Vec<Vec<Row>>> {
    let mut runs: Vec<Vec<Row>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 0..RUNS {
        for ((name, run), runs) in configs.iter_mut().zip(runs.iter_mut()) {
            let row = run()?;
            eprintln!("xtask bench: heavy: {part} round {}: {name} {:.2} s", round + 1, row.wall_s);
            runs.push(row);
        }
    }
    Ok(runs)
}

/// The row of the median run (by wall time): the VM's noise moves a single run by tens of
/// percent.
fn median_row(mut rows: Vec<Row>) -> Row {
    rows.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
    rows.swap_remove(rows.len() / 2)
}

/// The median over rounds of (`a`'s added time ÷ `b`'s), each added time against the same
/// round's bare run: a ratio of runs made side by side, which drift moves least.
fn paired_ratio(bare: &[Row], a: &[Row], b: &[Row]) -> Option<f64> {
    let mut ratios: Vec<f64> = bare
        .iter()
        .zip(a.iter().zip(b))
        .filter(|(bare, (_, b))| b.wall_s > bare.wall_s)
        .map(|(bare, (a, b))| (a.wall_s - bare.wall_s) / (b.wall_s - bare.wall_s))
        .collect();
    ratios.sort_by(f64::total_cmp);
    (!ratios.is_empty()).then(|| ratios[ratios.len() / 2])
}

/// A row of a tool timed alone (bare, heaptrack, memray): no report of memtrace's.
fn timed_row(name: &str, wall_s: f64, allocs: Option<u64>, file_bytes: u64) -> Row {
    Row { name: name.into(), wall_s, allocs, report: None, file_bytes }
}

fn timed(cmd: &mut Command) -> Result<f64> {
    let started = Instant::now();
    let status = cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().with_context(|| format!("{cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(started.elapsed().as_secs_f64())
}

/// "calls to allocation functions: N" from heaptrack_print.
fn heaptrack_allocs(file: &Path) -> Option<u64> {
    let out = Command::new("heaptrack_print")
        .arg("-f")
        .arg(file)
        .args(["--print-peaks=0", "--print-allocators=0", "--print-temporary=0"])
        .output();
    let text = String::from_utf8_lossy(&out.ok()?.stdout).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("calls to allocation functions: "))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

fn memtrace_row(memtrace: &Path, name: &str, command: &[&OsStr], cache: &Path, extra: &[&str]) -> Result<Row> {
    let data = target_dir().join("bench").join("heavy.data");
    let wall_s = timed(
        Command::new(memtrace)
            .env("MEMTRACE_CACHE_DIR", cache)
            .args(["record", "-q", "--force", "-o"])
            .arg(&data)
            .args(extra)
            .arg("--")
            .args(command),
    )?;
    // The report's head only: a whole `--by stack` report of this run is hundreds of MB of
    // JSON, and holding it here would swell this process (whose peak RSS the next recorder
    // inherits through fork and exec in `ru_maxrss`) and the machine's memory pressure.
    let out = Command::new(memtrace).args(["report", "--format", "json", "--top", "1", "-i"]).arg(&data).output()?;
    let mut report: serde_json::Value = serde_json::from_slice(&out.stdout).context("memtrace report --format json")?;
    // The C library's malloc family, which heaptrack's preloaded library intercepts; the
    // allocators bundled in libraries (pyarrow's mimalloc) are listed apart.
    let glibc = report["allocators"]
        .as_array()
        .map(|all| all.iter().filter(|a| a["family"] == "glibc").filter_map(|a| a["allocs"].as_u64()).sum::<u64>());
    let allocs = glibc.filter(|&n| n > 0).or(report["totals"]["user"]["allocs"].as_u64());
    // The share of user allocations whose stack holds a Python frame.
    let user = &report["stacks"]["user"];
    let (with, total) =
        (user["allocs_with_python"].as_u64().unwrap_or(0), user["allocs_with_stack"].as_u64().unwrap_or(0));
    report["python_share"] = serde_json::json!(if total > 0 { with as f64 / total as f64 } else { 0.0 });
    let file_bytes = fs::metadata(&data).map(|m| m.len()).unwrap_or(0);
    // What the run wrote (its recording, cache entries) reaches the disk before the next
    // run starts, not during it.
    let _ = Command::new("sync").status();
    Ok(Row { name: name.into(), wall_s, allocs, report: Some(report), file_bytes })
}

/// The table of `rows` (the first is bare, the second heaptrack); `python`: with the
/// column of the share of stacks holding a Python frame.
fn table(rows: &[Row], bare_s: f64, python: bool) -> String {
    let heaptrack_added = rows[1].wall_s - bare_s;
    let (py_head, py_rule) = if python { (" with a Python frame |", " ---: |") } else { ("", "") };
    let mut out = format!(
        "| under | wall s | added / heaptrack's added | allocations counted | user stacks cut short |{py_head} lost events | copies | ring bytes an event | tool CPU s | tool peak RSS | BPF maps | file |\n\
         | --- | ---: | ---: | ---: | ---: |{py_rule} ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    );
    for r in rows {
        let ratio =
            if r.name == "bare" { "—".to_string() } else { format!("{:.2}", (r.wall_s - bare_s) / heaptrack_added) };
        let allocs = r.allocs.map_or("—".to_string(), |a| a.to_string());
        let file = if r.file_bytes > 0 { format!("{:.2} MB", r.file_bytes as f64 / 1e6) } else { "—".into() };
        match &r.report {
            Some(j) => {
                let stacks = &j["stacks"]["user"];
                let with = stacks["allocs_with_stack"].as_u64().unwrap_or(0);
                let cut = stacks["allocs_truncated"].as_u64().unwrap_or(0);
                let cut = if with > 0 { format!("{:.1} %", 100.0 * cut as f64 / with as f64) } else { "—".into() };
                let rec = &j["recorder"];
                let share = j["python_share"].as_f64().unwrap_or(0.0);
                let share = if python { format!(" {:.1} % |", 100.0 * share) } else { String::new() };
                // What the probes sent through the rings (events, stacks, stack copies, the
                // rest) per event recorded.
                let ring = &rec["ring_bytes"];
                let ring: u64 =
                    ["events", "stacks", "stack_copies", "other"].iter().filter_map(|k| ring[*k].as_u64()).sum();
                let events = j["events"].as_u64().unwrap_or(0);
                let per_event = if events > 0 { format!("{:.1}", ring as f64 / events as f64) } else { "—".into() };
                let _ = writeln!(
                    out,
                    "| {} | {:.2} | {ratio} | {allocs} | {cut} |{share} {} | {} | {per_event} | {:.1} | {:.0} MB | {:.0} MB | {file} |",
                    r.name,
                    r.wall_s,
                    j["lost_events"],
                    rec["unwind_copies"].as_u64().unwrap_or(0),
                    rec["cpu_ns"].as_u64().unwrap_or(0) as f64 / 1e9,
                    rec["peak_rss_bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
                    rec["bpf_map_bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
                );
            }
            None => {
                let share = if python { " — |" } else { "" };
                let _ = writeln!(
                    out,
                    "| {} | {:.2} | {ratio} | {allocs} | — |{share} — | — | — | — | — | — | {file} |",
                    r.name, r.wall_s
                );
            }
        }
    }
    out
}

/// The section's table and notes.
pub fn section(memtrace: &Path) -> Result<String> {
    let python = venv()?;
    let dir = target_dir().join("bench");
    let script = dir.join("heavy.py");
    fs::write(&script, SCRIPT)?;
    let ht = dir.join("heavy-heaptrack");
    let mr = dir.join("heavy-memray.bin");
    let cache = dir.join("heavy-unwind-cache");
    let command = [python.as_os_str(), script.as_os_str()];
    const COLD: &str = "memtrace record, cold cache (first run on the machine)";
    const WARM: &str = "memtrace record, warm cache (any later run)";
    const NO_PY: &str = "memtrace record --python-frames off";
    const FP: &str = "memtrace record --call-graph fp";
    const FP_NO_PY: &str = "memtrace record --call-graph fp --python-frames off";
    let mut configs: Vec<Config<'_>> = vec![
        ("bare".into(), Box::new(|| Ok(timed_row("bare", timed(Command::new(&python).arg(&script))?, None, 0)))),
        (
            "heaptrack (LD_PRELOAD, libunwind)".into(),
            Box::new(|| {
                let file = ht.with_extension("zst");
                let _ = fs::remove_file(&file);
                let wall_s = timed(Command::new("heaptrack").arg("-o").arg(&ht).arg(&python).arg(&script))?;
                let bytes = fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
                Ok(timed_row("heaptrack (LD_PRELOAD, libunwind)", wall_s, heaptrack_allocs(&file), bytes))
            }),
        ),
        (
            "memray run --native".into(),
            Box::new(|| {
                let _ = fs::remove_file(&mr);
                let wall_s = timed(
                    Command::new(&python)
                        .args(["-m", "memray", "run", "--native", "-q", "-f", "-o"])
                        .arg(&mr)
                        .arg(&script),
                )?;
                Ok(timed_row("memray run --native", wall_s, None, fs::metadata(&mr).map(|m| m.len()).unwrap_or(0)))
            }),
        ),
    ];
    // The warm rows' cache, filled once before the rounds.
    let _ = fs::remove_dir_all(&cache);
    memtrace_row(memtrace, "warm-up", &command, &cache, &[])?;
    for (name, extra) in [
        (WARM, &[][..]),
        (NO_PY, &["--python-frames", "off"][..]),
        (FP, &["--call-graph", "fp"][..]),
        (FP_NO_PY, &["--call-graph", "fp", "--python-frames", "off"][..]),
        ("memtrace record --no-user-stacks", &["--no-user-stacks"][..]),
    ] {
        let (cache, command) = (&cache, &command);
        configs.push((name.into(), Box::new(move || memtrace_row(memtrace, name, command, cache, extra))));
    }
    // Cold: each run starts without the cache (and leaves it filled for the next round),
    // last in its round: the tables it builds and stores are written back to disk while
    // the next run goes, which slowed the warm run after it by up to 0.8 s.
    configs.push((
        COLD.into(),
        Box::new(|| {
            let _ = fs::remove_dir_all(&cache);
            memtrace_row(memtrace, COLD, &command, &cache, &[])
        }),
    ));
    let runs = rounds(&mut configs, "python")?;
    drop(configs);
    let runs_of = |name: &str| &runs[runs.iter().position(|r| r[0].name == name).expect("a configuration")];
    // What walking the native frames by call-frame information costs against frame
    // pointers, the same Python frames walked or not either way.
    let ratio = |dwarf: &str, fp: &str| {
        paired_ratio(runs_of("bare"), runs_of(dwarf), runs_of(fp)).map_or("—".into(), |r| format!("{r:.2}"))
    };
    let ratios = (ratio(WARM, FP), ratio(NO_PY, FP_NO_PY));
    let mut rows: Vec<Row> = runs.into_iter().map(median_row).collect();
    // Shown before the warm rows, as a first run comes before later ones.
    let cold = rows.pop().expect("the cold row");
    rows.insert(3, cold);
    let bare_s = rows[0].wall_s;

    // The always-on agent, sampled as it runs by default, around the same command.
    let wall_s = timed(
        Command::new(memtrace)
            .env("MEMTRACE_CACHE_DIR", &cache)
            .args(["serve", "--listen", "127.0.0.1:16161", "--"])
            .arg(&python)
            .arg(&script),
    )?;
    eprintln!("xtask bench: heavy: memtrace serve (sampled) {wall_s:.2} s");
    rows.push(Row {
        name: "memtrace serve (default: sampled 1/512 KiB, warm cache)".into(),
        wall_s,
        allocs: None,
        report: None,
        file_bytes: 0,
    });

    let mut out = table(&rows, bare_s, true);
    let _ = writeln!(
        out,
        "\n`--call-graph dwarf` added time ÷ `--call-graph fp` added time (the median of the rounds' ratios, each against its round's bare run): {} with Python frames (warm cache), {} with `--python-frames off` on both.",
        ratios.0, ratios.1,
    );
    // The other allocators the warm run found (heaptrack sees none of their calls).
    let others: Vec<String> = rows
        .iter()
        .find(|r| r.name == WARM)
        .and_then(|r| r.report.as_ref()?["allocators"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|a| a["family"] != "glibc" && a["allocs"].as_u64().unwrap_or(0) > 0)
        .map(|a| {
            let module = a["module"].as_str().unwrap_or("?").rsplit('/').next().unwrap_or("?").to_string();
            format!("{} allocations of the {} in {module}", a["allocs"], a["family"].as_str().unwrap_or("?"))
        })
        .collect();
    if !others.is_empty() {
        let _ = writeln!(
            out,
            "
Beside the C library's malloc family counted above, memtrace found and counted {} (the warm run), which an LD_PRELOAD tracer does not see.",
            others.join(", ")
        );
    }
    let sqlite = native_table(memtrace, &cache, &sqlite()?)?;
    let cc1 = native_table(memtrace, &cache, &cc1()?)?;
    let versions = Command::new(&python)
        .args(["-c", "import numpy, pandas, pyarrow, memray, sys; print(sys.version.split()[0], numpy.__version__, pandas.__version__, pyarrow.__version__, memray.__version__)"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "\nThe script (`xtask/src/heavy_bench.rs`) builds a 120,000-row data frame, groups, joins, \
         converts it to Arrow, writes and reads Parquet, filters and dumps JSON; Python, numpy, pandas, \
         pyarrow, memray: {versions}. The runs alternate: 3 rounds, each running every row's command once in turn (the cold run last, without the cache; a first run fills it for the warm rows), with `sync` after each memtrace run; each row is its median run by wall time. \"Copies\" are stacks \
         the probes could not walk because a library's unwind table was not ready yet (they are finished in \
         userspace from a copy of the stack); the cold run builds every table (and fills the cache), later \
         runs load a program's tables before it maps the libraries. \"Ring bytes an event\" is what the probes sent \
         through the rings (event records, each distinct stack once, stack copies, task and mapping records) \
         per event recorded. heaptrack counts calls to allocation \
         functions; memtrace's count is of the C library's malloc family; \"with a Python frame\" is the share of \
         them whose stack names the Python function and line (the rest run before the script's first line, \
         in interpreter start-up and shutdown, or in threads running no Python); `--python-frames off` \
         shows what walking them costs; `serve` writes no file and \
         keeps its figures for scrapes; memray's count is not comparable \
         (it also sees Python's own allocator) and is left out."
    );
    let _ = write!(
        out,
        "\n### A Debian program: sqlite3\n\n{sqlite}\n`sqlite3 :memory: '.read heavy.sql'` (the script is `SQL` in \
         `xtask/src/heavy_bench.rs`): builds, indexes, groups, joins, sorts and dumps as JSON a 200,000-row table; \
         libsqlite3 from Debian, without frame pointers. Runs alternate as above (3 rounds, each row its median run); memtrace ran with a \
         warm unwind cache. Its allocations are many, small and short-lived, from shallow stacks: the case where an \
         in-process tracer's cheap call beats two traps per allocation.\n"
    );
    let _ = write!(
        out,
        "\n### A Debian C++ program with deep recursive stacks: GCC's cc1\n\n{cc1}\n`cc1 -quiet -O2 heavy-cc1.c -o /dev/null` \
         (GCC 12's compiler proper from Debian, a C++ program without frame pointers; the source is `c_source` in \
         `xtask/src/heavy_bench.rs`: {CC1_FUNCTIONS} functions whose expressions nest 4 to 25 deep, through which the \
         parser and folders recurse): millions of allocations through `xmalloc`/`xcalloc`/`operator new` from a few \
         hundred callers, stacks up to ~250 frames. Runs alternate as above; memtrace ran with a warm unwind \
         cache. memtrace keeps up to 511 frames of a user stack (deeper ones are cut there and counted as cut short); \
         heaptrack keeps at most 64 (`Trace::MAX_SIZE`) and says nothing of the rest; `perf` 127 by default \
         (`kernel.perf_event_max_stack`). On both programs, `--time-resolution 10ms` keeps times as heaptrack does \
         (a timestamp each 10 ms; memtrace's default is 1 µs); what is left of the difference in size is mostly \
         addresses, which memtrace keeps (`dump`, realloc's old block, pairing across chunks) and heaptrack's \
         interpreter turns into allocation indices.\n"
    );
    Ok(out)
}

/// A Debian program the section measures beside the Python script.
struct Native {
    /// What the progress lines call it.
    name: &'static str,
    program: PathBuf,
    args: Vec<String>,
}

impl Native {
    fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.args(&self.args);
        c
    }
}

/// The sqlite3 shell running [`SQL`] in memory.
fn sqlite() -> Result<Native> {
    let sql = target_dir().join("bench").join("heavy.sql");
    fs::write(&sql, SQL)?;
    Ok(Native {
        name: "sqlite3",
        program: "/usr/bin/sqlite3".into(),
        args: vec![":memory:".into(), format!(".read {}", sql.display())],
    })
}

/// GCC's compiler proper (`cc1`, a C++ program from Debian's gcc, without frame pointers)
/// compiling [`c_source`] at -O2.
fn cc1() -> Result<Native> {
    let out = Command::new("gcc").arg("-print-prog-name=cc1").output().context("gcc -print-prog-name=cc1")?;
    let program = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !program.is_absolute() || !program.exists() {
        bail!("gcc names no cc1 ({})", program.display());
    }
    let src = target_dir().join("bench").join("heavy-cc1.c");
    fs::write(&src, c_source(CC1_FUNCTIONS))?;
    Ok(Native {
        name: "cc1",
        program,
        args: ["-quiet", "-O2", &src.display().to_string(), "-o", "/dev/null"].map(String::from).to_vec(),
    })
}

/// Functions in the C file cc1 compiles.
const CC1_FUNCTIONS: usize = 300;

/// A C file of `functions` functions, each filling and folding an array with an expression
/// nested 4 to 25 deep (GCC's parser and folders recurse through each level), and one
/// function calling them all: millions of allocations, stacks up to ~250 frames deep.
pub fn c_source(functions: usize) -> String {
    let mut out = String::new();
    for f in 0..functions {
        let mut e = "x".to_string();
        for d in 0..4 + (f % 8) * 3 {
            e = if d % 3 == 0 { format!("({e} + {}) * (y ^ {d})", d % 7) } else { format!("({e} - y)") };
        }
        let _ = writeln!(
            out,
            "static int g{f}(int x, int y) {{ int a[8]; for (int i = 0; i < 8; i++) a[i] = {e} + i; int s = 0; \
             for (int i = 0; i < 8; i++) s += a[i] * (i + {f}); if (s > {f}) return s; \
             switch (s & 3) {{ case 0: return s + x; case 1: return s - y; default: return s ^ {f}; }} }}"
        );
    }
    out.push_str("int entry(int x, int y) {\n    int s = 0;\n");
    for f in 0..functions {
        let _ = writeln!(out, "    s += g{f}(x + {f}, y);");
    }
    out.push_str("    return s;\n}\n");
    out
}

/// A Debian program's rows: bare, heaptrack, memtrace (warm cache, then by frame pointers).
fn native_table(memtrace: &Path, cache: &Path, native: &Native) -> Result<String> {
    let dir = target_dir().join("bench");
    let name = native.name;
    let ht = dir.join(format!("{name}-heaptrack"));
    let mut command = vec![native.program.as_os_str()];
    command.extend(native.args.iter().map(OsStr::new));
    // The first run fills the cache with the program's tables; the rows are the later runs.
    memtrace_row(memtrace, "warm-up", &command, cache, &[])?;
    let mut configs: Vec<Config<'_>> = vec![
        ("bare".into(), Box::new(|| Ok(timed_row("bare", timed(&mut native.command())?, None, 0)))),
        (
            "heaptrack (LD_PRELOAD, libunwind)".into(),
            Box::new(|| {
                let file = ht.with_extension("zst");
                let _ = fs::remove_file(&file);
                let wall_s =
                    timed(Command::new("heaptrack").arg("-o").arg(&ht).arg(&native.program).args(&native.args))?;
                let bytes = fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
                Ok(timed_row("heaptrack (LD_PRELOAD, libunwind)", wall_s, heaptrack_allocs(&file), bytes))
            }),
        ),
    ];
    for (row_name, extra) in [
        ("memtrace record (warm cache)", &[][..]),
        ("memtrace record --call-graph fp", &["--call-graph", "fp"][..]),
        ("memtrace record --time-resolution 10ms", &["--time-resolution", "10ms"][..]),
    ] {
        let command = &command;
        configs.push((row_name.into(), Box::new(move || memtrace_row(memtrace, row_name, command, cache, extra))));
    }
    let runs = rounds(&mut configs, name)?;
    drop(configs);
    let rows: Vec<Row> = runs.into_iter().map(median_row).collect();
    let bare_s = rows[0].wall_s;
    Ok(table(&rows, bare_s, false))
}

/// `cargo xtask bench heavy`: this section alone, replaced in BENCHMARKS.md.
pub fn run_alone() -> Result<()> {
    crate::require_root("bench")?;
    crate::setup()?;
    crate::ensure_tools(&[("heaptrack", "heaptrack"), ("sqlite3", "sqlite3"), ("gcc", "gcc")])?;
    let (memtrace, _) = build_release()?;
    fs::create_dir_all(target_dir().join("bench"))?;
    crate::update_benchmarks("heavy-programs", &SECTION, &section(&memtrace)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(wall_s: f64) -> Row {
        timed_row("r", wall_s, None, 0)
    }

    #[test]
    fn a_paired_ratio_takes_each_round_against_its_own_bare_run() {
        // The machine slows in the last round: two rounds' ratios are 2, the other 2.1
        // (the ratio of the medians would be 2.1).
        let bare = [row(1.0), row(1.0), row(1.5)];
        let dwarf = [row(3.0), row(3.1), row(3.5)];
        let fp = [row(2.0), row(2.0), row(2.5)];
        assert_eq!(paired_ratio(&bare, &dwarf, &fp), Some(2.0));
        // A round whose second run added nothing says nothing.
        assert_eq!(paired_ratio(&bare[..1], &dwarf[..1], &[row(0.9)]), None);
        assert_eq!(median_row(vec![row(3.0), row(1.0), row(2.0)]).wall_s, 2.0);
    }

    #[test]
    fn the_c_source_nests_as_said_and_compiles() {
        let src = c_source(16);
        assert_eq!(src.matches("static int g").count(), 16);
        // Function 7 nests 4 + 7 * 3 = 25 deep: 25 parentheses open before its `x`.
        let g7 = src.lines().find(|l| l.starts_with("static int g7(")).unwrap();
        let expr = &g7[g7.find("a[i] = ").unwrap() + 7..];
        assert_eq!(expr.chars().take_while(|&c| c == '(').count(), 25, "{expr}");
        let dir = std::env::temp_dir().join(format!("memtrace-c-source-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("gen.c");
        fs::write(&file, &src).unwrap();
        let out = Command::new("gcc").args(["-fsyntax-only", "-Wall", "-Werror"]).arg(&file).output().unwrap();
        let _ = fs::remove_dir_all(&dir);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    #[test]
    fn the_section_is_replaced_in_place_or_appended() {
        let doc = "# B\n\nintro\n";
        let once = SECTION.replace(doc, "| a |");
        assert!(once.starts_with("# B\n\nintro\n\n## Heavy"), "{once}");
        let twice = SECTION.replace(&format!("{once}\n## Later\n"), "| b |");
        assert!(twice.contains("| b |") && !twice.contains("| a |") && twice.ends_with("## Later\n"), "{twice}");
    }
}
