//! Unwind-table maps installed ahead of need. Putting a table's map into the probes'
//! array of table maps waits for an RCU grace period (the kernel's
//! `maybe_wait_bpf_programs`): 26–202 ms from a table asked for to a table in the probes
//! on a 16-CPU machine, while its build took 0–3 ms, and meanwhile the program, on a core
//! of its own, ran into the new library and its stacks needed copies. A table that fits
//! one of these maps is written into it through its memory mapping and its slot pointed
//! there (`SLOT_MAPS`, a plain array: no grace period), so it is in the probes the moment
//! it is built. A thread of its own installs a replacement for each map used, and the
//! first ones while the session starts. Tables too big for any size here go into a map of
//! their own as before.
use std::{
    os::fd::{AsFd as _, OwnedFd},
    sync::mpsc::{self, Receiver, Sender},
};

use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData};
use memtrace_common::{MAX_TABLES, TABLE_MAPS};

use super::{outer, read_back_fd, write_mmapped};
use crate::unwind::{store::InstallResult, table::Table};

/// Sizes kept ready (elements of 8 bytes) and how many of each: small libraries are the
/// many (a Cython module's table is a few KiB), 12 MiB in all. Sized by a program with
/// many libraries: PostgreSQL's server maps 40, whose tables need 25, 16, 9 and 5 maps of
/// these sizes (its own is one of the largest, 584 KiB). With 32/16/8/2, the libraries
/// took the largest maps and its own table waited ~90 ms in a map of its own while its
/// first allocations needed stack copies.
const CLASSES: [(u32, usize); 4] = [(2 << 10, 32), (8 << 10, 24), (32 << 10, 16), (128 << 10, 6)];

/// A map installed ahead: its entry in the array of table maps.
struct Ready {
    entry: u32,
    map: MapData,
}

pub struct TablePool {
    /// Ready maps by size class.
    free: Vec<Vec<Ready>>,
    /// From the thread: (class, map) installed.
    installed: Receiver<(usize, Ready)>,
    /// To the thread: a map of this class was used.
    used: Sender<usize>,
    slot_maps: Array<MapData, u32>,
}

impl TablePool {
    /// Starts the thread that installs maps into `outer` (the array of table maps), each
    /// class filled at once.
    pub fn start(outer: OwnedFd, slot_maps: Array<MapData, u32>) -> Result<Self> {
        let (used, asks) = mpsc::channel();
        let (sent, installed) = mpsc::channel();
        std::thread::Builder::new()
            .name("memtrace-tblpool".into())
            .spawn(move || fill(outer, asks, sent))
            .context("starting the unwind-table pool's thread")?;
        Ok(Self { free: CLASSES.iter().map(|_| Vec::new()).collect(), installed, used, slot_maps })
    }

    /// Writes the table of `slot` into a ready map that holds it and points the slot there:
    /// None when no ready map of its size or the next is left (install it in a map of its
    /// own).
    pub fn place(&mut self, slot: u32, table: &Table) -> Option<InstallResult> {
        for (class, ready) in self.installed.try_iter() {
            self.free[class].push(ready);
        }
        let class = class_for(table.element_count(), |c| !self.free[c].is_empty())?;
        let ready = self.free[class].pop()?;
        let _ = self.used.send(class);
        let placed = write_mmapped(&ready.map, table)
            .context("filling an unwind table")
            .and_then(|()| self.slot_maps.set(slot, ready.entry, 0).context("pointing a slot at its table"))
            .map(|()| read_back_fd(&ready.map, table));
        Some(placed)
    }
}

/// The size class a table of `elements` goes into, given which classes have a map ready:
/// the smallest that holds it, else the next; a small table does not take a map a big one
/// will need (it goes into a map of its own).
fn class_for(elements: usize, ready: impl Fn(usize) -> bool) -> Option<usize> {
    let fits = (0..CLASSES.len()).find(|&c| CLASSES[c].0 as usize >= elements.max(1))?;
    (fits..CLASSES.len().min(fits + 2)).find(|&c| ready(c))
}

/// The pool's thread: fills every class, then replaces each map used, a batch at a time
/// (the batch's installs share their grace periods). Ends when the pool is dropped, or
/// when the array has no entry left.
fn fill(outer: OwnedFd, used: Receiver<usize>, installed: Sender<(usize, Ready)>) {
    let mut next = MAX_TABLES;
    let mut wanted: Vec<usize> =
        CLASSES.iter().enumerate().flat_map(|(class, &(_, kept))| std::iter::repeat_n(class, kept)).collect();
    loop {
        let mut batch: Vec<(usize, Ready)> = Vec::new();
        for class in wanted {
            if next >= TABLE_MAPS {
                return;
            }
            let obj = aya_obj::Map::new_from_params(
                aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
                4,
                8,
                CLASSES[class].0,
                super::TABLE_FLAGS,
            );
            match MapData::create(obj, &format!("memtrace_up{next}"), None) {
                Ok(map) => batch.push((class, Ready { entry: next, map })),
                Err(e) => {
                    log::debug!("unwind-table pool: creating a map: {e}");
                    return;
                }
            }
            next += 1;
        }
        let entries: Vec<_> = batch.iter().map(|(_, r)| (r.entry, r.map.fd().as_fd())).collect();
        let results = outer::set_all(outer.as_fd(), &entries);
        drop(entries);
        for ((class, ready), result) in batch.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    if installed.send((class, ready)).is_err() {
                        return;
                    }
                }
                Err(e) => log::debug!("unwind-table pool: installing map {}: {e}", ready.entry),
            }
        }
        let Ok(first) = used.recv() else { return };
        wanted = std::iter::once(first).chain(used.try_iter()).collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_takes_its_own_size_or_the_next_never_a_bigger_one() {
        let all = |_: usize| true;
        assert_eq!(class_for(0, all), Some(0));
        assert_eq!(class_for(2 << 10, all), Some(0));
        assert_eq!(class_for((2 << 10) + 1, all), Some(1));
        assert_eq!(class_for(128 << 10, all), Some(3));
        assert_eq!(class_for((128 << 10) + 1, all), None, "too big for any");
        assert_eq!(class_for(100, |c| c != 0), Some(1));
        assert_eq!(class_for(100, |c| c >= 2), None, "the largest maps stay for large tables");
        assert_eq!(class_for(20 << 10, |c| c != 2), Some(3));
        assert_eq!(class_for(20 << 10, |c| c < 3), Some(2));
        assert_eq!(class_for(100 << 10, |c| c < 3), None);
    }

    #[test]
    fn classes_grow_and_fit_the_array() {
        assert!(CLASSES.windows(2).all(|w| w[0].0 < w[1].0));
        let kept: usize = CLASSES.iter().map(|c| c.1).sum();
        assert!(kept < (TABLE_MAPS - MAX_TABLES) as usize / 8, "room for many replacements");
        let bytes: u64 = CLASSES.iter().map(|&(n, k)| u64::from(n) * 8 * k as u64).sum();
        assert!(bytes <= 12 << 20, "{bytes} bytes kept ready");
        // The install thread offers the pool every table up to this size.
        assert_eq!(CLASSES[CLASSES.len() - 1].0 as usize * 8, crate::unwind::store::PLACEABLE_BYTES);
    }
}
