//! `memtrace dump`: every event of a recording, one line each, in time order (like
//! `perf script`): timestamp, pid/tid, CPU, kind, address and sizes, the stack reference
//! and, for kernel events, call site, GFP flags, node and a slab cache's name. With `-g` each allocation's stack
//! follows it, symbolized, one frame a line; `--stacks` lists every stack a `stack=N`
//! refers to. A realloc names the block it replaced (`old=`), an exec its parent process.
use std::{collections::HashMap, io::Write, path::Path};

use anyhow::{Result, anyhow, bail};
use memtrace_common::{Kind, TaskEvent, flags};

use crate::{
    event::{Event, Task},
    report::{Outline, for_each_event, read_definitions, read_outline},
    stacks::{Frame, StackTable},
};

/// What `dump` prints besides the events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DumpOptions {
    /// Each allocation's stack under it (`-g`).
    pub call_graph: bool,
    /// The stack definitions instead of the events (`--stacks`).
    pub stacks: bool,
}

/// One event as a line of text: what `memtrace dump` prints. `old` is the block a realloc
/// replaced; `parent`, the parent process of an exec when known.
pub struct Line<'a> {
    pub event: &'a Event,
    pub old: Option<u64>,
    pub parent: Option<u32>,
    /// Fractional digits of the time: as many as the recording's resolution has (6 for
    /// its default 1 µs, as `perf script`; 9 for `--exact-times`).
    pub digits: u32,
    /// A kernel allocation the probes caused (`report`'s "not counted"), marked `(probes)`.
    pub probes: bool,
    /// A new slab's pages (`report`'s "slab pages"), marked `(slab pages)`.
    pub slab_pages: bool,
    /// The name of a kmem_cache_alloc's slab cache, where the recording has it (else its
    /// address is shown).
    pub cache: Option<&'a str>,
}

impl<'a> Line<'a> {
    pub fn new(event: &'a Event) -> Self {
        Self { event, old: None, parent: None, digits: 9, probes: false, slab_pages: false, cache: None }
    }
}

/// The fractional digits a time resolution has: 9 for 1 ns (or unknown), 6 for 1 µs, 2
/// for 10 ms.
pub fn time_digits(resolution_ns: u64) -> u32 {
    9u32.saturating_sub(resolution_ns.max(1).ilog10())
}

impl std::fmt::Display for Line<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ts = self.event.ts_ns();
        let digits = self.digits.min(9);
        match digits {
            0 => write!(f, "{:>6} ", ts / 1_000_000_000)?,
            d => {
                let frac = (ts % 1_000_000_000) / 10u64.pow(9 - d);
                write!(f, "{:>6}.{frac:0width$} ", ts / 1_000_000_000, width = d as usize)?
            }
        }
        match self.event {
            Event::Alloc(a) => {
                let remapped = matches!(a.kind, Kind::Mmap | Kind::MmapReserved) && a.flags & flags::BY_REALLOC != 0;
                let name = match (remapped, a.kind) {
                    (true, Kind::MmapReserved) => "mremap_reserve",
                    (true, _) => "mremap",
                    _ => a.kind.name(),
                };
                write!(f, "{}/{} {} {} 0x{:x}", a.pid, a.tid, Cpu(a.kind, a.cpu), name, a.ptr)?;
                if matches!(a.kind, Kind::Realloc | Kind::ReallocArray) || remapped && self.old.is_some() {
                    write!(f, " old=0x{:x}", self.old.unwrap_or(0))?;
                }
                write!(f, " req={} alloc={}", a.bytes_req, a.bytes_alloc)?;
                if a.stack != 0 {
                    write!(f, " stack={}", a.stack)?;
                }
                if a.kind == Kind::PageAlloc {
                    // As perf prints mm_page_alloc: the order and migrate type (no node).
                    write!(f, " gfp=0x{:x} order={} migratetype={}", a.gfp_flags, a.order, a.node)?;
                } else if a.kind.is_kernel() {
                    write!(f, " call_site=0x{:x} gfp=0x{:x} node={}", a.call_site, a.gfp_flags, a.node)?;
                    match (self.cache, a.cache) {
                        (Some(name), _) => write!(f, " cache={name}")?,
                        (None, 0) => {}
                        (None, cache) => write!(f, " cache=0x{cache:x}")?,
                    }
                }
                if self.probes {
                    f.write_str(" (probes)")?;
                } else if self.slab_pages {
                    f.write_str(" (slab pages)")?;
                }
                Ok(())
            }
            Event::Free(x) => {
                write!(f, "{}/{} {} {} 0x{:x}", x.pid, x.tid, Cpu(x.kind, x.cpu), x.kind.name(), x.ptr)?;
                if x.flags & flags::BY_REALLOC != 0 {
                    f.write_str(if x.kind == Kind::Munmap { " (mremap)" } else { " (realloc)" })?;
                }
                if x.arg != 0 {
                    write!(f, " arg={}", x.arg)?;
                }
                Ok(())
            }
            Event::Task(t) => {
                write!(f, "{}/{} {:?} comm={}", t.pid, t.tid, t.event, t.comm)?;
                match t.event {
                    TaskEvent::Fork => write!(f, " ppid={}", t.ppid)?,
                    TaskEvent::Exec => match self.parent {
                        Some(p) => write!(f, " ppid={p}")?,
                        None => f.write_str(" ppid=?")?,
                    },
                    _ => {}
                }
                if !t.filename.is_empty() {
                    write!(f, " {}", t.filename)?;
                }
                Ok(())
            }
        }
    }
}

/// One frame of a stack as `-g` and `--stacks` print it, like `perf script`: address (a
/// file offset for user code), function with source location, module.
fn frame_line(f: &Frame) -> String {
    format!("\t{:>16x} {f} ({})", f.address, f.module)
}

/// What a dump remembers between events: the pending old block of each thread's realloc,
/// and each process's parent.
#[derive(Default)]
struct State {
    realloc_old: HashMap<u32, u64>,
    parents: HashMap<u32, u32>,
    /// [`Line::digits`] (0: 9).
    digits: u32,
}

impl State {
    fn line<'a>(&mut self, e: &'a Event) -> Line<'a> {
        let mut line = Line::new(e);
        if self.digits > 0 {
            line.digits = self.digits;
        }
        match e {
            // The old block's free is stamped when realloc was entered: before the new block.
            Event::Free(x) if x.flags & flags::BY_REALLOC != 0 => {
                self.realloc_old.insert(x.tid, x.ptr);
            }
            // A user allocation takes it; the kernel's on the thread's behalf in between (the
            // pages the copy faults in) do not.
            Event::Alloc(a) if !a.kind.is_kernel() => {
                let old = self.realloc_old.remove(&a.tid);
                if matches!(a.kind, Kind::Realloc | Kind::ReallocArray | Kind::Mmap | Kind::MmapReserved) {
                    line.old = old;
                }
            }
            Event::Alloc(_) => {}
            Event::Task(t) => self.task(t, &mut line),
            Event::Free(_) => {}
        }
        line
    }

    fn task(&mut self, t: &Task, line: &mut Line<'_>) {
        match t.event {
            TaskEvent::Fork => {
                self.parents.insert(t.pid, t.ppid);
            }
            // The probes do not report an exec's parent; the fork that made the process
            // does, when it was traced.
            TaskEvent::Exec => {
                line.parent = (t.ppid != 0).then_some(t.ppid).or_else(|| self.parents.get(&t.pid).copied())
            }
            TaskEvent::Exit if t.pid == t.tid => {
                self.parents.remove(&t.pid);
            }
            _ => {}
        }
    }
}

/// Writes the recording at `path` to `out` as `opts` asks; a reader that went away
/// (broken pipe) ends the dump quietly.
pub fn dump(path: &Path, opts: DumpOptions, out: &mut dyn Write) -> Result<()> {
    // The stacks when they are printed; else only the outline (the counters, the damage),
    // which costs a read of the file, no inflating. Damage is said on stderr either way,
    // as `report` says it (a truncated file dumped nothing, in silence).
    let (mut table, outline) = if opts.call_graph || opts.stacks {
        let defs = read_definitions(path)?;
        let mut table = defs.stacks;
        if !defs.finalized {
            table.fill_missing_symbols();
        }
        (Some(table), Outline { stats: defs.stats, warnings: defs.warnings, damaged_at: defs.damaged_at })
    } else {
        (None, read_outline(path)?)
    };
    for warning in &outline.warnings {
        eprintln!("memtrace: warning: {}: {warning}", path.display());
    }
    let result = if opts.stacks {
        write_stacks(table.as_mut().expect("read above"), out)
    } else {
        write_events(path, table.as_mut(), &outline, out)?
    };
    match result.and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => bail!("writing: {e}"),
        _ => Ok(()),
    }
}

fn write_events(
    path: &Path,
    mut table: Option<&mut StackTable>,
    outline: &Outline,
    out: &mut dyn Write,
) -> Result<std::io::Result<()>> {
    let mut failed = None;
    let until = outline.damaged_at;
    let resolution = crate::recording::Reader::open(path).map_or(0, |r| r.meta.time_resolution_ns);
    let caches: HashMap<u64, &str> = outline.stats.slab_caches.iter().map(|(c, n)| (*c, n.as_str())).collect();
    let mut state = State { digits: time_digits(resolution), ..Default::default() };
    // With the stacks read (-g), the probes' own kernel allocations and slab pages are marked.
    let probes = table.as_deref().map(StackTable::uprobe_stacks).unwrap_or_default();
    let slab_pages = table.as_deref().map(StackTable::slab_page_stacks).unwrap_or_default();
    for_each_event(path, until, &mut |e| {
        if failed.is_some() {
            return;
        }
        let mut line = state.line(&e);
        line.probes = matches!(&e, Event::Alloc(a) if a.kind.is_kernel() && probes.contains(&a.stack));
        line.slab_pages = matches!(&e, Event::Alloc(a) if a.kind == Kind::PageAlloc && slab_pages.contains(&a.stack));
        if let Event::Alloc(a) = &e {
            line.cache = caches.get(&a.cache).copied();
        }
        let mut text = format!("{line}\n");
        if let (Some(table), Event::Alloc(a)) = (table.as_deref_mut(), &e) {
            for f in table.frames(a.stack, a.call_site) {
                text.push_str(&frame_line(&f));
                text.push('\n');
            }
            text.push('\n');
        }
        if let Err(err) = out.write_all(text.as_bytes()) {
            failed = Some(err);
        }
    })
    .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(failed.map_or(Ok(()), Err))
}

/// Every stack of the recording, numbered as events refer to them (`stack=N`).
fn write_stacks(table: &mut StackTable, out: &mut dyn Write) -> std::io::Result<()> {
    let ids = table.stack_list();
    for (id, pid, truncated) in ids {
        let reference = u64::from(id) + 1;
        writeln!(out, "stack={reference} pid={pid}{}", if truncated { " (cut short)" } else { "" })?;
        for f in table.frames_once(reference, 0) {
            writeln!(out, "{}", frame_line(&f))?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// An event's CPU: the recording keeps a kernel event's, not a user one's (`cpu-`; a
/// thread's allocations are its own whichever CPU ran them).
struct Cpu(Kind, u16);

impl std::fmt::Display for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_kernel() { write!(f, "cpu{}", self.1) } else { f.write_str("cpu-") }
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::{Kind, TaskEvent};

    use super::*;
    use crate::event::{Alloc, Free, Task};

    fn alloc(kind: Kind, ptr: u64, stack: u64) -> Event {
        Event::Alloc(Alloc {
            ts_ns: 1_500_000_123,
            pid: 42,
            tid: 43,
            cpu: 1,
            kind,
            flags: 0,
            ptr,
            bytes_req: 64,
            bytes_alloc: 96,
            stack,
            call_site: if kind.is_kernel() { 0xffff_ffff_8123_4567 } else { 0 },
            gfp_flags: if kind.is_kernel() { 0xcc0 } else { 0 },
            node: -1,
            order: 0,
            allocator: 0,
            cache: 0,
        })
    }

    fn task(event: TaskEvent, pid: u32, ppid: u32) -> Event {
        Event::Task(Task {
            ts_ns: 0,
            event,
            flags: 0,
            pid,
            tid: pid,
            ppid,
            comm: "prog".into(),
            filename: if event == TaskEvent::Exec { "/bin/prog".into() } else { String::new() },
        })
    }

    #[test]
    fn events_read_as_one_line_each() {
        let kmalloc = alloc(Kind::Kmalloc, 0xffff_8880_0000_1000, 3);
        assert_eq!(
            Line::new(&kmalloc).to_string(),
            "     1.500000123 42/43 cpu1 kmalloc 0xffff888000001000 req=64 alloc=96 stack=3 call_site=0xffffffff81234567 gfp=0xcc0 node=-1"
        );
        // A kmem_cache_alloc names its cache: by name where the recording has it.
        let Event::Alloc(mut cached) = alloc(Kind::KmemCacheAlloc, 0xffff_8880_0000_2000, 3) else { unreachable!() };
        cached.cache = 0xffff_8880_0000_0100;
        let cached = Event::Alloc(cached);
        let mut line = Line::new(&cached);
        assert!(line.to_string().ends_with(" node=-1 cache=0xffff888000000100"), "{line}");
        line.cache = Some("names_cache");
        assert!(line.to_string().ends_with(" node=-1 cache=names_cache"), "{line}");
        // A page's migrate type is not a node (a helper read `node=1` on a one-node VM).
        let Event::Alloc(mut page) = alloc(Kind::PageAlloc, 0xffff_ea00_0000_0040, 3) else { unreachable!() };
        (page.call_site, page.bytes_req, page.bytes_alloc, page.order, page.node) = (0, 8192, 8192, 1, 2);
        assert_eq!(
            Line::new(&Event::Alloc(page)).to_string(),
            "     1.500000123 42/43 cpu1 page 0xffffea0000000040 req=8192 alloc=8192 stack=3 gfp=0xcc0 order=1 migratetype=2"
        );
        let free = Event::Free(Free {
            ts_ns: 7,
            pid: 42,
            tid: 43,
            cpu: 0,
            kind: Kind::Free,
            flags: flags::BY_REALLOC,
            ptr: 0x10,
            arg: 0,
        });
        assert_eq!(Line::new(&free).to_string(), "     0.000000007 42/43 cpu- free 0x10 (realloc)");
        // As many digits as the recording's resolution holds.
        assert_eq!((time_digits(0), time_digits(1), time_digits(1000), time_digits(10_000_000)), (9, 9, 6, 2));
        assert_eq!(time_digits(1_000_000_000), 0);
        let micro = Line { digits: 6, ..Line::new(&kmalloc) };
        assert!(micro.to_string().starts_with("     1.500000 42/43 "), "{micro}");
        let seconds = Line { digits: 0, ..Line::new(&kmalloc) };
        assert!(seconds.to_string().starts_with("     1 42/43 "), "{seconds}");
        // A realloc names the block it replaced; an allocation without a stack says none.
        let mut state = State::default();
        let _ = state.line(&free);
        let _ = state.line(&kmalloc);
        let realloc = alloc(Kind::Realloc, 0x20, 0);
        assert_eq!(
            state.line(&realloc).to_string(),
            "     1.500000123 42/43 cpu- realloc 0x20 old=0x10 req=64 alloc=96"
        );
        assert!(state.line(&realloc).to_string().contains(" old=0x0 "), "realloc(NULL, n)");
    }

    #[test]
    fn an_exec_names_its_real_parent_when_the_fork_was_seen() {
        let mut state = State::default();
        assert_eq!(
            state.line(&task(TaskEvent::Exec, 5, 0)).to_string(),
            "     0.000000000 5/5 Exec comm=prog ppid=? /bin/prog"
        );
        assert_eq!(state.line(&task(TaskEvent::Fork, 6, 5)).to_string(), "     0.000000000 6/6 Fork comm=prog ppid=5");
        assert_eq!(
            state.line(&task(TaskEvent::Exec, 6, 0)).to_string(),
            "     0.000000000 6/6 Exec comm=prog ppid=5 /bin/prog"
        );
        assert_eq!(state.line(&task(TaskEvent::Exit, 6, 0)).to_string(), "     0.000000000 6/6 Exit comm=prog");
    }

    #[test]
    fn call_graphs_and_stack_definitions_resolve_every_reference() {
        let path = crate::report::tests::recording();
        let mut out = Vec::new();
        dump(path, DumpOptions { call_graph: true, stacks: false }, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().skip_while(|l| !l.contains(" malloc ") || !l.contains("stack=1")).collect();
        assert_eq!(lines[1], "\t             100 parse_request (app.c:42) (app)", "{text}");
        assert_eq!(lines[4], "\t             400 main (app.c:200) (app)", "{text}");
        assert_eq!(lines[5], "", "a blank line after each stack, like perf script");
        let kernel = text.split("\n\n").find(|b| b.contains(" kmalloc ")).unwrap();
        assert!(kernel.lines().nth(1).unwrap().contains("alloc_pipe_info ([kernel])"), "{kernel}");

        let mut out = Vec::new();
        dump(path, DumpOptions { call_graph: false, stacks: true }, &mut out).unwrap();
        let stacks = String::from_utf8(out).unwrap();
        let mut events = Vec::new();
        dump(path, DumpOptions::default(), &mut events).unwrap();
        for reference in String::from_utf8(events).unwrap().split_whitespace().filter(|w| w.starts_with("stack=")) {
            assert!(stacks.lines().any(|l| l.split_whitespace().next() == Some(reference)), "{reference}:\n{stacks}");
        }
        assert!(stacks.contains("stack=3 pid=42 (cut short)"), "{stacks}");
    }
}
