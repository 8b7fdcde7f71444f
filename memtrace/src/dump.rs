//! `memtrace dump`: every event of a recording, one line each, in time order (like
//! `perf script`): timestamp, pid/tid, CPU, kind, address and sizes, the stack id and, for
//! kernel events, call site, GFP flags and node.
use std::{io::Write, path::Path};

use anyhow::{Result, anyhow, bail};
use memtrace_common::flags;

use crate::{event::Event, report::for_each_event};

/// One event as a line of text: what `memtrace dump` prints.
pub struct Line<'a>(pub &'a Event);

impl std::fmt::Display for Line<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ts = self.0.ts_ns();
        write!(f, "{:>6}.{:09} ", ts / 1_000_000_000, ts % 1_000_000_000)?;
        match self.0 {
            Event::Alloc(a) => {
                write!(
                    f,
                    "{}/{} cpu{} {} 0x{:x} req={} alloc={} stack={}",
                    a.pid,
                    a.tid,
                    a.cpu,
                    a.kind.name(),
                    a.ptr,
                    a.bytes_req,
                    a.bytes_alloc,
                    a.stack
                )?;
                if a.kind.is_kernel() {
                    write!(f, " call_site=0x{:x} gfp=0x{:x} node={}", a.call_site, a.gfp_flags, a.node)?;
                }
                Ok(())
            }
            Event::Free(x) => {
                write!(f, "{}/{} cpu{} {} 0x{:x}", x.pid, x.tid, x.cpu, x.kind.name(), x.ptr)?;
                if x.flags & flags::BY_REALLOC != 0 {
                    f.write_str(" (realloc)")?;
                }
                if x.arg != 0 {
                    write!(f, " arg={}", x.arg)?;
                }
                Ok(())
            }
            Event::Task(t) => {
                write!(f, "{}/{} {:?} comm={} ppid={} {}", t.pid, t.tid, t.event, t.comm, t.ppid, t.filename)
            }
        }
    }
}

/// Writes every event of the recording at `path` to `out`; a reader that went away (broken
/// pipe) ends the dump quietly.
pub fn dump(path: &Path, out: &mut dyn Write) -> Result<()> {
    let mut failed = None;
    for_each_event(path, &mut |e| {
        if failed.is_none()
            && let Err(err) = writeln!(out, "{}", Line(&e))
        {
            failed = Some(err);
        }
    })
    .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    match failed.map_or_else(|| out.flush(), Err) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => bail!("writing: {e}"),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::{Kind, TaskEvent};

    use super::*;
    use crate::event::{Alloc, Free, Task};

    #[test]
    fn events_read_as_one_line_each() {
        let alloc = Event::Alloc(Alloc {
            ts_ns: 1_500_000_123,
            pid: 42,
            tid: 43,
            cpu: 1,
            kind: Kind::Kmalloc,
            flags: 0,
            ptr: 0xffff_8880_0000_1000,
            bytes_req: 64,
            bytes_alloc: 96,
            stack: 3,
            call_site: 0xffff_ffff_8123_4567,
            gfp_flags: 0xcc0,
            node: -1,
            order: 0,
            allocator: 0,
        });
        assert_eq!(
            Line(&alloc).to_string(),
            "     1.500000123 42/43 cpu1 kmalloc 0xffff888000001000 req=64 alloc=96 stack=3 call_site=0xffffffff81234567 gfp=0xcc0 node=-1"
        );
        let free = Event::Free(Free {
            ts_ns: 7,
            pid: 42,
            tid: 44,
            cpu: 0,
            kind: Kind::Free,
            flags: flags::BY_REALLOC,
            ptr: 0x10,
            arg: 0,
        });
        assert_eq!(Line(&free).to_string(), "     0.000000007 42/44 cpu0 free 0x10 (realloc)");
        let exec = Event::Task(Task {
            ts_ns: 0,
            event: TaskEvent::Exec,
            flags: 0,
            pid: 5,
            tid: 5,
            ppid: 1,
            comm: "prog".into(),
            filename: "/bin/prog".into(),
        });
        assert_eq!(Line(&exec).to_string(), "     0.000000000 5/5 Exec comm=prog ppid=1 /bin/prog");
    }
}
