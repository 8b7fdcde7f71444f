//! The text report: what was traced, the totals per domain, losses and stack coverage,
//! then one table row per group (or the blocks still live, with `--leaks`). Tables fit the
//! width of the layout: figures are dropped by priority, never cut; names are ellipsized.
use std::{fmt::Write as _, io};

use memtrace_common::Kind;

use super::{
    analyze::{GroupRow, Summary},
    options::{ReportColumn, ReportOptions},
};
use crate::{
    analysis::Domain,
    columns::{ColumnChoice, TextColumn, TextTable, Width, ellipsize},
    grouping::{GroupBy, domain_letter, domain_name, process_name, stack_start},
    units::{bytes, count, counted, duration, percent},
};

fn describe_target(a: &Summary) -> String {
    let m = &a.meta;
    let target = match m.mode.as_str() {
        "command" => {
            let words: Vec<String> = m.target_command.iter().map(|w| shell_word(w)).collect();
            format!("command `{}` (pid {})", words.join(" "), m.target_pids.first().copied().unwrap_or(0))
        }
        "pid" => {
            let pid = m.target_pids.first().copied().unwrap_or(0);
            format!("pid {pid} ({})", process_name(pid, &a.comms))
        }
        _ => "the whole machine".into(),
    };
    format!("{target} on {}, kernel {}, {} of events", m.hostname, m.kernel_release, duration(a.duration_ns))
}

/// `word` as a shell reads it back: as it is when nothing in it is special, else quoted
/// (`sh -c 'trap "" INT; sleep 6'`, not `sh -c trap "" INT; sleep 6`).
pub(super) fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A line of a stack under its row, cut to the width.
fn frame_line(indent: &str, f: &crate::stacks::Frame, width: Width) -> String {
    let line = format!("{indent}{}{f}", if f.kernel { "[k] " } else { "" });
    match width {
        Width::Columns(w) => ellipsize(&line, w),
        Width::Unlimited => line,
    }
}

pub fn render_text(a: &Summary, opts: &ReportOptions) -> String {
    let mut text = Vec::new();
    write_text(a, opts, &mut text).expect("writing to memory");
    String::from_utf8(text).expect("the report is UTF-8")
}

/// Below this many bytes of report text, [`write_text`] holds it before writing it out.
const WRITE_EVERY: usize = 1 << 16;

/// The text report written to `w` as it is made: the rows of a report by stack of a deep
/// recording, each with its whole stack (named as it is written, when the analysis left
/// rows unnamed), run to hundreds of MB.
pub fn write_text(a: &Summary, opts: &ReportOptions, w: &mut dyn io::Write) -> io::Result<()> {
    let mut out = String::new();
    let _ = writeln!(out, "memtrace report: {}", describe_target(a));
    if !a.allocators.is_empty() {
        // An allocator no call reached while another served the program (glibc's, under a
        // preloaded jemalloc: its malloc is not the program's) says nothing (the JSON keeps
        // it): "0 allocs, 0 frees; probed 20ms after perl mapped it" read as calls missed.
        let others_served = a.allocators.iter().any(|r| r.allocs + r.frees > 0);
        for r in a.allocators.iter().filter(|r| !others_served || r.allocs + r.frees > 0) {
            let prefix = if r.prefix.is_empty() { String::new() } else { format!(", prefix {}", r.prefix) };
            let how = crate::sizes::Family::from_name(&r.family).map_or("", |f| f.usable_source());
            let late = match &r.probed_late {
                Some(l) => {
                    let name = a.comms.get(&l.pid).map_or(format!("{}", l.pid), |c| format!("{c} [{}]", l.pid));
                    let what = match (l.exec, l.program.as_str()) {
                        (false, _) => "mapped it".to_string(),
                        (true, program) if program.is_empty() || program == r.module => "exec'd it".to_string(),
                        (true, program) => format!("exec'd {program}"),
                    };
                    format!("; probed {} after {name} {what}", crate::units::duration(l.after_ns))
                }
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "allocator: {} ({}{prefix}): {} allocs, {} frees; {how}{late}",
                r.module, r.family, r.allocs, r.frees
            );
        }
        if a.user_mmaps.calls + a.user_mmaps.remaps > 0 {
            let calls = [(a.user_mmaps.calls, "call", "calls"), (a.user_mmaps.remaps, "mremap", "mremaps")]
                .into_iter()
                .filter(|c| c.0 > 0)
                .map(|(n, one, many)| counted(n, one, many))
                .collect::<Vec<_>>()
                .join(" and ");
            // Sampled: the calls recorded, where the user row estimates every call.
            let sampled = a.meta.sample_bytes.is_some() || a.stats.sampled_from.is_some();
            let _ = writeln!(
                out,
                "mmap: {calls} {}outside the allocators ({}), counted in the user row beside their allocations{}",
                if sampled { "recorded " } else { "" },
                bytes(a.user_mmaps.bytes_alloc),
                if sampled { " (which estimates all of them)" } else { "" }
            );
        }
    } else if let Some(alloc) = a.meta.allocator.as_ref().filter(|_| opts.filters.domain.admits(Domain::User)) {
        let how = if a.meta.allocator_is_glibc {
            "allocated = malloc_usable_size, read from glibc's chunk headers"
        } else {
            "allocator unknown to memtrace: allocated = requested"
        };
        let _ = writeln!(out, "allocator: {alloc} ({how})");
    }
    if let Some((from, n)) = a.stats.sampled_from {
        let after = duration(from.saturating_sub(a.meta.start_monotonic_ns));
        let _ = writeln!(
            out,
            "warning: the rings overflowed {after} into the recording; from then on user allocations were sampled (each byte with probability 1/{n}): figures are estimates"
        );
    }
    if let Some(n) = a.meta.sample_bytes {
        let _ = writeln!(
            out,
            "sampled: each byte of user allocations with probability 1/{n}; user figures are estimates (kernel figures exact)"
        );
    }
    for w in &a.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out.push('\n');

    let any = |t: &crate::analysis::Totals| t.stats.allocs + t.stats.frees + t.unmatched_frees > 0;
    if a.totals.iter().any(|(d, t)| opts.filters.domain.admits(*d) && any(t)) {
        out.push_str(&totals_table(a, opts).render(opts.layout.width));
    } else {
        // A table of headers alone says nothing.
        // (`--domain gpu` of a recording of user and kernel allocations: some were.)
        let recorded = a.totals.values().any(any) || a.allocs_by_pid.values().any(|&n| n > 0);
        let what = if opts.filters.is_empty() && !recorded {
            "no allocation was recorded"
        } else {
            "no allocation matches the filters"
        };
        let _ = writeln!(out, "{what}");
    }
    for (domain, t) in a.totals.iter().filter(|(d, t)| opts.filters.domain.admits(**d) && t.stats.failed > 0) {
        let _ = writeln!(
            out,
            "{}: {} failed (not allocations), asking for {}",
            domain_name(*domain),
            counted(t.stats.failed, "call", "calls"),
            bytes(t.stats.failed_bytes_req)
        );
    }
    let s = &a.stats;
    let _ = writeln!(
        out,
        "lost events: {}{}",
        count(s.lost_events),
        if s.lost_stacks + s.lost_inflight + s.lost_kernel_live > 0 {
            format!(
                " (also: {} stacks, {} untracked calls, {} untracked kernel blocks)",
                s.lost_stacks, s.lost_inflight, s.lost_kernel_live
            )
        } else {
            String::new()
        }
    );
    let o = &a.probe_overhead;
    // Kernel allocations: said where the report counts some (not under `--domain user` or
    // `--kind malloc`).
    let kernel_counted =
        [Kind::Kmalloc, Kind::KmemCacheAlloc, Kind::PageAlloc].iter().any(|&k| opts.filters.admits_kind(k));
    if o.allocs + o.map_allocs > 0 && kernel_counted {
        let mut parts = Vec::new();
        if o.allocs > 0 {
            parts.push(format!(
                "{} ({}) the kernel's uprobe machinery made for the probes (breakpoint pages, return instances)",
                counted(o.allocs, "kernel allocation", "kernel allocations"),
                bytes(o.bytes_alloc)
            ));
        }
        if o.map_allocs > 0 {
            parts.push(format!(
                "{} ({}) for the probes' own maps, left out as they were made",
                counted(o.map_allocs, "kernel allocation", "kernel allocations"),
                bytes(o.map_bytes_alloc)
            ));
        }
        let _ = writeln!(out, "not counted: {}", parts.join("; "));
    }
    if a.slab_pages.allocs > 0 {
        let _ = writeln!(
            out,
            "slab pages: {} ({}) holding slab objects, left out of the kernel figures: the objects count at their own \
             kmalloc or kmem_cache_alloc (--kind page counts every page)",
            counted(a.slab_pages.allocs, "page allocation", "page allocations"),
            bytes(a.slab_pages.bytes_alloc)
        );
    }
    for (domain, c) in &a.coverage {
        if c.allocs_with_stack == 0 {
            continue;
        }
        let mut share = format!(
            "{}, {}",
            percent(100.0 * c.allocs_truncated as f64 / c.allocs_with_stack as f64),
            counted(c.stacks_truncated, "distinct stack", "distinct stacks")
        );
        if c.allocs_no_room > 0 {
            let _ = write!(share, "; {} for want of ring room for a stack copy", count(c.allocs_no_room));
        }
        let (cut, walk) = match domain {
            // The user part of a kernel allocation's stack (the code that made the system
            // call) is what can be cut; how it was walked is said on the user line.
            Domain::Kernel => ("cut short in user space", String::new()),
            _ if a.meta.call_graph == "dwarf" => ("cut short", "; walked by call-frame information".to_string()),
            _ => ("cut short", "; walked by frame pointers".to_string()),
        };
        let _ = writeln!(
            out,
            "{} stacks: {} of {} allocations {cut} ({share}{walk})",
            domain_name(*domain),
            count(c.allocs_truncated),
            count(c.allocs_with_stack),
        );
        if c.allocs_with_python > 0 {
            let _ = writeln!(
                out,
                "{} stacks with Python frames: {} of {} allocations ({})",
                domain_name(*domain),
                count(c.allocs_with_python),
                count(c.allocs_with_stack),
                percent(100.0 * c.allocs_with_python as f64 / c.allocs_with_stack as f64),
            );
        }
    }
    if let Some(code) = s.exit_code {
        // How it ended, in the recorder's words where they say more than the shell's code
        // (139 is a SIGSEGV, not a status the program chose).
        match s.end_reason.strip_prefix("the command ") {
            Some(how) if how.starts_with("was killed") => {
                let _ = writeln!(out, "command {how} (exit status {code}, as a shell tells it)");
            }
            _ => {
                let _ = writeln!(out, "command exit status: {code}");
            }
        }
    }
    out.push('\n');
    if opts.timeline {
        out.push_str(&super::sparkline::render_timeline(a, opts));
    }
    if opts.histogram {
        out.push_str(&super::sizes::render_histogram(a, opts));
    }

    if opts.leaks {
        render_leaks(a, opts, &mut out);
        return w.write_all(out.as_bytes());
    }
    if opts.top == Some(0) {
        // The totals alone.
        out.pop();
        return w.write_all(out.as_bytes());
    }
    // A process's rows are one per domain (user, reserved, kernel): processes are counted.
    let rows = match a.by {
        GroupBy::Process => a.groups.iter().flat_map(|g| &g.pids).collect::<std::collections::HashSet<_>>().len(),
        _ => a.groups.len(),
    };
    let counted = if rows < a.rows_in_all {
        format!("the first {rows} of {}", a.by.count(a.rows_in_all))
    } else {
        a.by.count(rows)
    };
    if a.rows_in_all == 0 {
        let _ = writeln!(out, "{counted}");
        return w.write_all(out.as_bytes());
    }
    let _ = writeln!(out, "{counted}, sorted by {}:", opts.sort.describe());
    let lines = groups_table(a, opts).lines(opts.layout.width);
    let mut lines = lines.iter();
    if let Some(h) = lines.next() {
        let _ = writeln!(out, "{h}");
    }
    for (line, g) in lines.zip(&a.groups) {
        let _ = writeln!(out, "{line}");
        if a.by == GroupBy::Stack {
            // Each row, then its whole stack.
            let frames = crate::export::row_frames(a, g);
            for f in frames.iter().skip(stack_start(g.domain, &frames) + 1) {
                let _ = writeln!(out, "{}", frame_line("      ", f, opts.layout.width));
            }
        }
        if out.len() >= WRITE_EVERY {
            w.write_all(out.as_bytes())?;
            out.clear();
        }
    }
    w.write_all(out.as_bytes())
}

/// One row per domain: what was allocated and freed, and what could not be paired.
fn totals_table(a: &Summary, opts: &ReportOptions) -> TextTable {
    let totals: Vec<_> = a.totals.iter().filter(|(d, _)| opts.filters.domain.admits(**d)).collect();
    let column = |header: &str, rank: usize, cell: &dyn Fn(&crate::analysis::Totals) -> String| {
        TextColumn::new(header, rank, totals.iter().map(|(_, t)| cell(t)).collect())
    };
    TextTable {
        columns: vec![
            TextColumn::new("", 0, totals.iter().map(|(d, _)| domain_name(**d).to_string()).collect()),
            column("ALLOCS", 1, &|t| count(t.stats.allocs)),
            column("FREES", 2, &|t| count(t.stats.frees)),
            column("REQUESTED", 3, &|t| bytes(t.stats.bytes_req)),
            column("ALLOCATED", 4, &|t| bytes(t.stats.bytes_alloc)),
            column("WASTED", 7, &|t| bytes(t.stats.wasted())),
            column("FRAG", 8, &|t| percent(t.stats.frag_pct())),
            column("LIVE", 9, &|t| count(t.stats.live_allocs)),
            column("LIVE BYTES", 5, &|t| bytes(t.stats.live_bytes_req)),
            column("PEAK LIVE", 10, &|t| bytes(t.stats.peak_live_bytes_req)),
            column("FREES W/O ALLOC", 6, &|t| count(t.unmatched_frees)),
        ],
        names: None,
        keep_all: false,
    }
}

/// A group's figure in `column`.
fn cell(column: ReportColumn, g: &GroupRow) -> String {
    let s = &g.stats;
    let per_call = |v: u64| v.checked_div(s.allocs).map_or_else(|| "-".into(), bytes);
    match column {
        ReportColumn::Allocs => count(s.allocs),
        ReportColumn::Frees => count(s.frees),
        ReportColumn::Req => bytes(s.bytes_req),
        ReportColumn::Alloc => bytes(s.bytes_alloc),
        ReportColumn::ReqPerCall => per_call(s.bytes_req),
        ReportColumn::AllocPerCall => per_call(s.bytes_alloc),
        ReportColumn::Frag => percent(s.frag_pct()),
        ReportColumn::Wasted => bytes(s.wasted()),
        ReportColumn::LiveAllocs => count(s.live_allocs),
        ReportColumn::Live => bytes(s.live_bytes_req),
        ReportColumn::Peak => bytes(s.live_bytes_req_at_peak),
        ReportColumn::MaxLive => bytes(s.peak_live_bytes_req),
        ReportColumn::P50 => s.lifetimes.quantile(0.5).map_or("-".into(), duration),
        ReportColumn::P99 => s.lifetimes.quantile(0.99).map_or("-".into(), duration),
        ReportColumn::Temp => count(s.temporary),
        ReportColumn::OtherCpu => {
            if g.domain == Domain::Kernel {
                count(s.freed_on_other_cpu)
            } else {
                "-".into()
            }
        }
    }
}

/// A group's name in its row: its label, or with `--by stack` the first frame (the whole
/// stack follows the row).
fn name(a: &Summary, g: &GroupRow, by: GroupBy) -> String {
    match by {
        GroupBy::Stack => {
            let frames = crate::export::row_frames(a, g);
            frames.get(stack_start(g.domain, &frames)).map(|f| f.to_string()).unwrap_or_default()
        }
        _ => g.label.clone(),
    }
}

fn groups_table(a: &Summary, opts: &ReportOptions) -> TextTable {
    let sorted = opts.sort.column();
    let mut columns =
        vec![TextColumn::new("", 0, a.groups.iter().map(|g| domain_letter(g.domain).to_string()).collect())];
    for c in opts.layout.candidates(&ReportColumn::ALL) {
        let rank = if Some(c) == sorted { 1 } else { c.rank() };
        columns.push(TextColumn::new(c.header(), rank, a.groups.iter().map(|g| cell(c, g)).collect()));
    }
    TextTable {
        columns,
        names: Some((a.by.header().into(), a.groups.iter().map(|g| name(a, g, a.by)).collect())),
        keep_all: !matches!(opts.layout.columns, ColumnChoice::Fit),
    }
}

fn render_leaks(a: &Summary, opts: &ReportOptions, out: &mut String) {
    let t = &a.leak_totals;
    let _ = writeln!(
        out,
        "{} ({}) still live at the end{}, from {}, sorted by {}{}:",
        counted(t.blocks, "block", "blocks"),
        bytes(t.bytes_req),
        // `--older-than`: those alone are counted (none younger is a leak yet).
        opts.older_than
            .map_or(String::new(), |d| format!(", allocated over {} before it", duration(d.as_nanos() as u64))),
        counted(t.stacks as u64, "stack", "stacks"),
        opts.sort.describe_leaks(),
        if a.leaks.len() < t.stacks { format!("; the first {}", a.leaks.len()) } else { String::new() },
    );
    if t.runtime_blocks > 0 {
        let _ = writeln!(
            out,
            "(not counted: {} ({}) that the C++ runtime keeps for the process's life: libstdc++'s \
             emergency exception pool, which heaptrack and valgrind free at exit)",
            counted(t.runtime_blocks, "block", "blocks"),
            bytes(t.runtime_bytes_req)
        );
    }
    for l in &a.leaks {
        let _ = writeln!(
            out,
            "\n{}, {} requested ({} allocated), oldest {} old, {} pid {}",
            counted(l.blocks, "block", "blocks"),
            bytes(l.bytes_req),
            bytes(l.bytes_alloc),
            duration(l.oldest_age_ns),
            domain_name(l.domain),
            l.pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(",")
        );
        for f in &l.frames {
            let _ = writeln!(out, "{}", frame_line("    ", f, opts.layout.width));
        }
    }
}
