//! A file's unwind table as the probes read it: 8-byte rows sorted by pc (relative to a
//! base), a page index that narrows a lookup to the rows of one 4 KiB page of code, and the
//! file's segments. Built once per file from its call-frame information ([`cfi`]), shared
//! by every process that maps the file, kept in the disk cache, and looked up here with
//! the same search the probes run (`memtrace_common::unwind::find_row`).
//!
//! [`cfi`]: super::cfi
use memtrace_common::{
    UnwindRule,
    unwind::{encode_row, find_row, row_rule, table},
};

use super::cfi::{Row, Segment};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// The file virtual address row pcs are relative to.
    pub pc_base: u64,
    /// Per 4 KiB page from `pc_base`, the index of the row in effect at its start; one more
    /// entry for the end.
    pub pages: Vec<u32>,
    /// Encoded rows (`memtrace_common::unwind::encode_row`).
    pub rows: Vec<u64>,
    /// Where the file's loadable segments sit (to turn a mapping's file offset into the
    /// file's virtual addresses).
    pub segments: Vec<Segment>,
}

/// Code a table covers at most from its base (pcs are 32 bits).
const MAX_SPAN: u64 = 1 << 32;

impl Table {
    /// Packs sorted, merged rows (as `Cfi::rows` gives them).
    pub fn from_rows(rows: &[Row], segments: Vec<Segment>) -> Self {
        let Some(first) = rows.first() else {
            return Self { pc_base: 0, pages: vec![0], rows: Vec::new(), segments };
        };
        let pc_base = first.pc;
        let packed: Vec<u64> = rows
            .iter()
            .take_while(|r| r.pc - pc_base < MAX_SPAN)
            .map(|r| encode_row((r.pc - pc_base) as u32, r.rule))
            .collect();
        // The last row ends the covered code (the frame-pointer rule, as `Cfi::rows` ends
        // every FDE): the index spans up to it.
        let span = rows.last().map_or(0, |r| (r.pc - pc_base).min(MAX_SPAN - 1)) + 1;
        let n_pages = span.div_ceil(1 << table::PAGE_SHIFT) as usize;
        let mut pages = Vec::with_capacity(n_pages + 1);
        let mut row = 0usize;
        for page in 0..=n_pages {
            let start = (page as u64) << table::PAGE_SHIFT;
            while row + 1 < packed.len() && u64::from(memtrace_common::unwind::row_pc(packed[row + 1])) <= start {
                row += 1;
            }
            pages.push(row as u32);
        }
        Self { pc_base, pages, rows: packed, segments }
    }

    pub fn page_count(&self) -> u32 {
        self.pages.len().saturating_sub(1) as u32
    }

    /// The table as the probes' array holds it (`memtrace_common::unwind::table`).
    pub fn elements(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(2 + self.pages.len() + self.rows.len());
        out.push(self.pc_base);
        out.push(table::counts(self.page_count(), self.rows.len() as u32));
        out.extend(self.pages.iter().map(|&p| u64::from(p)));
        out.extend_from_slice(&self.rows);
        out
    }

    /// Bytes the table takes in the probes' array.
    pub fn byte_size(&self) -> usize {
        (2 + self.pages.len() + self.rows.len()) * 8
    }

    /// The rule for file virtual address `vaddr`, found as the probes find it; the
    /// frame-pointer rule outside the covered code.
    pub fn rule_at(&self, vaddr: u64) -> UnwindRule {
        let Some(rel) = vaddr.checked_sub(self.pc_base) else { return UnwindRule::FRAME_POINTER };
        let page = rel >> table::PAGE_SHIFT;
        if page >= u64::from(self.page_count()) {
            return UnwindRule::FRAME_POINTER;
        }
        let (lo, hi) = (self.pages[page as usize], self.pages[page as usize + 1]);
        find_row(lo, hi, rel as u32, |i| self.rows.get(i as usize).copied()).map_or(UnwindRule::FRAME_POINTER, row_rule)
    }

    /// The file virtual address of a file offset (in a loadable segment).
    pub fn vaddr_of_file_offset(&self, offset: u64) -> Option<u64> {
        super::cfi::vaddr_of_file_offset(&self.segments, offset)
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::unwind::kind;
    use proptest::prelude::*;

    use super::*;
    use crate::unwind::cfi::Cfi;

    fn rule(cfa: i32) -> UnwindRule {
        UnwindRule { cfa_offset: cfa, rbp_offset: 0, kind: kind::CFA_SP, _pad: 0 }
    }

    /// The rule in effect at `vaddr` by a plain scan of the rows.
    fn scan(rows: &[Row], vaddr: u64) -> UnwindRule {
        rows.iter().rev().find(|r| r.pc <= vaddr).map_or(UnwindRule::FRAME_POINTER, |r| r.rule)
    }

    #[test]
    fn lookups_agree_with_a_scan_of_the_rows() {
        let rows = vec![
            Row { pc: 0x1000, rule: rule(8) },
            Row { pc: 0x1004, rule: rule(16) },
            Row { pc: 0x2ff0, rule: rule(24) },
            Row { pc: 0x3000, rule: UnwindRule::STOP },
            Row { pc: 0x5000, rule: rule(8) },
            Row { pc: 0x5010, rule: UnwindRule::FRAME_POINTER },
        ];
        let t = Table::from_rows(&rows, vec![]);
        assert_eq!(t.pc_base, 0x1000);
        assert_eq!(t.page_count(), 5);
        for vaddr in 0xf00..0x5100 {
            assert_eq!(t.rule_at(vaddr), scan(&rows, vaddr), "{vaddr:#x}");
        }
        let elements = t.elements();
        assert_eq!(elements[0], 0x1000);
        assert_eq!(elements[1], table::counts(5, 6));
        assert_eq!(elements.len() * 8, t.byte_size());
    }

    proptest! {
        #[test]
        fn random_tables_agree_with_a_scan(gaps in proptest::collection::vec(1u64..6000, 1..60), probes in proptest::collection::vec(0u64..200_000, 50)) {
            let mut pc = 0x40_0000u64;
            let mut rows: Vec<Row> = gaps.iter().enumerate().map(|(i, g)| {
                pc += g;
                Row { pc, rule: if i % 3 == 2 { UnwindRule::STOP } else { rule(8 * (i as i32 + 1)) } }
            }).collect();
            // Tables end as every FDE does: code past it is walked by its frame pointer.
            rows.push(Row { pc: pc + 1, rule: UnwindRule::FRAME_POINTER });
            let t = Table::from_rows(&rows, vec![]);
            for p in probes {
                let vaddr = 0x40_0000 + p;
                prop_assert_eq!(t.rule_at(vaddr), scan(&rows, vaddr));
            }
        }
    }

    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(marker as *const () as u64)
    }

    /// The test binary's own table gives every row's rule at every row's pc and in between.
    #[test]
    fn a_real_binary_table_answers_like_its_rows() {
        let maps = crate::procfs::Maps::read_self().unwrap();
        let m = maps.find(marker()).unwrap();
        let cfi = Cfi::open(&m.path).unwrap();
        let rows = cfi.rows();
        let t = Table::from_rows(&rows, cfi.segments.clone());
        for w in rows.windows(2).step_by(7).take(20_000) {
            assert_eq!(t.rule_at(w[0].pc), w[0].rule);
            assert_eq!(t.rule_at(w[1].pc - 1), w[0].rule);
        }
        let vaddr = t.vaddr_of_file_offset(m.file_offset(marker())).unwrap();
        assert_eq!(t.rule_at(vaddr).cfa_offset, 8);
    }
}
