//! Rows that would print the same name: two call sites in one function (a kernel function
//! calling `kmem_cache_alloc` twice, two `malloc`s on one source line) are distinct rows,
//! so their names say where each call is — the call site's offset in its function, like
//! perf (`mas_wr_bnode+0x1a4`), or for user code the offset in its module
//! (`@prog+0x1234`).
use std::collections::HashMap;

use super::analyze::GroupRow;
use crate::{
    analysis::Domain,
    grouping::{GroupBy, site_frames},
};

/// Gives every row whose label another row also has a label that tells it apart.
pub fn disambiguate(rows: &mut [GroupRow], by: GroupBy) {
    if by != GroupBy::Site {
        return; // stacks print whole, functions and processes are one row each
    }
    let mut seen: HashMap<(Domain, &str), usize> = HashMap::new();
    for r in rows.iter() {
        *seen.entry((r.domain, r.label.as_str())).or_default() += 1;
    }
    let twins: Vec<usize> =
        rows.iter().enumerate().filter(|(_, r)| seen[&(r.domain, r.label.as_str())] > 1).map(|(i, _)| i).collect();
    if twins.is_empty() {
        return;
    }
    let mut kernel = KernelSymbols::default();
    for i in twins {
        let row = &mut rows[i];
        let Some(first) = site_frames(row.domain, &row.frames).first().cloned() else { continue };
        let Some(rest) = row.label.strip_prefix(&first.to_string()) else { continue };
        let named = if first.kernel {
            match kernel.offset(first.address, &first.function) {
                Some(offset) => format!("{}+0x{offset:x}", first.function),
                None => format!("{}@0x{:x}", first.function, first.address),
            }
        } else {
            format!("{first} @{}+0x{:x}", first.module, first.address)
        };
        row.label = format!("{named}{rest}");
    }
}

/// The running kernel's symbols (`/proc/kallsyms`), read when first needed: a recorded
/// kernel address's offset in its function, when this kernel is the one recorded (the
/// symbol found there has the recorded name).
#[derive(Default)]
struct KernelSymbols {
    /// Function starts, sorted (None: not read yet).
    starts: Option<Vec<(u64, String)>>,
}

impl KernelSymbols {
    fn offset(&mut self, address: u64, function: &str) -> Option<u64> {
        let starts = self.starts.get_or_insert_with(|| crate::procfs::kernel_functions(str::to_string));
        // A return address or call site points after the call: look up the byte before.
        let i = starts.partition_point(|(a, _)| *a <= address.saturating_sub(1)).checked_sub(1)?;
        let (start, name) = &starts[i];
        (name == function || name.split('.').next() == function.split('.').next()).then(|| address - start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{analysis::Stats, stacks::Frame};

    fn twin(function: &str, address: u64, kernel: bool) -> Frame {
        Frame {
            function: function.into(),
            file: (!kernel).then(|| "/src/a.c".into()),
            line: (!kernel).then_some(10),
            module: if kernel { "[kernel]".into() } else { "prog".into() },
            address,
            kernel,
            inlined: false,
            python: false,
            unknown: false,
            wrapper: false,
        }
    }

    fn row(domain: Domain, frames: Vec<Frame>) -> GroupRow {
        let label = frames.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(" ← ");
        GroupRow {
            domain,
            truncated: false,
            label,
            frames,
            kinds: vec![],
            pids: vec![],
            devices: vec![],
            stats: Stats::default(),
            stack: 0,
            call_site: 0,
            group: 0,
            timeline: vec![],
            allocator: None,
            caches: vec![],
        }
    }

    #[test]
    fn twins_get_their_call_sites_offset() {
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
        let (start, name) = kallsyms
            .lines()
            .find_map(|l| {
                let mut p = l.split_whitespace();
                let a = u64::from_str_radix(p.next()?, 16).ok()?;
                let _ = p.next()?;
                (p.next()? == "schedule").then_some((a, "schedule"))
            })
            .filter(|(a, _)| *a != 0)
            .expect("schedule in /proc/kallsyms (tests run as root)");
        let caller = twin("__schedule_loop", 0xffff_0000_0000_1000, true);
        let mut rows = vec![
            row(Domain::Kernel, vec![twin(name, start + 0x10, true), caller.clone()]),
            row(Domain::Kernel, vec![twin(name, start + 0x20, true), caller.clone()]),
            row(Domain::Kernel, vec![twin("other", 0xffff_0000_0000_2000, true), caller]),
            row(Domain::User, vec![twin("main", 0x1234, false)]),
            row(Domain::User, vec![twin("main", 0x1240, false)]),
        ];
        disambiguate(&mut rows, GroupBy::Site);
        let labels: Vec<&str> = rows.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "schedule+0x10 ← __schedule_loop",
                "schedule+0x20 ← __schedule_loop",
                "other ← __schedule_loop",
                "main (a.c:10) @prog+0x1234",
                "main (a.c:10) @prog+0x1240",
            ]
        );
        // A recording from another kernel (the names do not match): the address.
        let mut rows = vec![
            row(Domain::Kernel, vec![twin("not_here_xyz", start + 0x10, true)]),
            row(Domain::Kernel, vec![twin("not_here_xyz", start + 0x20, true)]),
        ];
        disambiguate(&mut rows, GroupBy::Site);
        assert_eq!(rows[0].label, format!("not_here_xyz@0x{:x}", start + 0x10));
    }
}
