//! Bounding the resident pages of a big object's debug information while the symbolizer
//! reads it in place.
//!
//! blazesym maps an object whole and parses its DWARF from the mapping. Each fault on a
//! file mapping maps up to 64 KiB of pages around it that the page cache holds (the
//! kernel's fault-around), and mapped pages stay in the resident set until the mapping
//! goes: reading the unit headers of libtriton's 141 MB of `.debug_info` (it has no
//! `.debug_aranges`) left 129 MB of it resident, the peak of a PyTorch recording. While a
//! big object is symbolized, [`bounded`] looks every [`PERIOD`] at how much of the file is
//! resident in this process and, [`RESIDENT_CAP`] past what was left after the last
//! reclaim, has the kernel reclaim the pages of the DWARF sections read whole ([`SCANNED`];
//! `MADV_PAGEOUT`: they leave the page cache, and what is read again comes from the disk).
//! On PyTorch: the stop's peak 257–268 MB → 222–243 MB, libtriton named in ~0.3 s instead
//! of ~0.23.
//!
//! Why not `MADV_DONTNEED`, which only drops page-table entries: it is safe only on a range
//! known to be still mapped to the file, and blazesym maps and unmaps the same file in the
//! middle of a call (reading its build id for a debug link; a parser that fails), as can
//! another thread; between reading `/proc/self/smaps` and the call, the range could be
//! unmapped and reused for heap, which `MADV_DONTNEED` would zero. `MADV_PAGEOUT` keeps the
//! contents of whatever it meets (anonymous memory goes to swap, or stays).

use std::{
    os::unix::fs::MetadataExt,
    path::Path,
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

/// How often the object's resident pages are looked at.
const PERIOD: Duration = Duration::from_millis(20);

/// The DWARF sections a reader goes through whole to index the units (their headers and
/// root entries, and the address ranges and location lists these point to), reclaimed. The
/// sections read by name and line lookups (`.debug_str`, `.debug_line`, `.debug_abbrev`)
/// are read again and again and stay: reclaimed too, they brought libtriton's peak 20 MB
/// lower but took it 0.7 s to name, where these alone add ~0.07 s.
const SCANNED: [&str; 5] = ["debug_info", "debug_ranges", "debug_rnglists", "debug_loc", "debug_loclists"];

/// Resident bytes of the object past which its debug information is reclaimed.
const RESIDENT_CAP: u64 = 16 << 20;

/// A read-only mapping of a file: its range, the file offset it starts at, and the file's
/// inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileMapping {
    start: usize,
    end: usize,
    offset: u64,
    inode: u64,
}

/// A `/proc/PID/maps` (or smaps) line's read-only file mapping.
fn read_only_file_mapping(line: &str) -> Option<FileMapping> {
    let mut fields = line.split_whitespace();
    let (range, perms, offset, _dev, inode) =
        (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
    let (start, end) = range.split_once('-')?;
    if !perms.starts_with("r-") {
        return None;
    }
    let inode = inode.parse::<u64>().ok().filter(|&i| i != 0)?;
    Some(FileMapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        offset: u64::from_str_radix(offset, 16).ok()?,
        inode,
    })
}

/// The read-only mappings of the whole file `inode` (from its start, at least `len` bytes,
/// as blazesym maps an object) in a `/proc/PID/smaps` text, with their resident bytes.
/// (Matched by inode alone: on overlayfs the device `stat` gives is not the one smaps
/// shows.)
fn resident_mappings(smaps: &str, inode: u64, len: u64) -> Vec<(FileMapping, u64)> {
    let whole = |m: &FileMapping| m.inode == inode && m.offset == 0 && (m.end - m.start) as u64 >= len;
    crate::procfs::smaps_rss(smaps)
        .filter_map(|(head, rss)| read_only_file_mapping(head).filter(whole).map(|m| (m, rss)))
        .collect()
}

/// The file ranges of the object's [`SCANNED`] sections (none if it has none, or is not an
/// ELF file).
fn debug_sections(path: &Path) -> Vec<(u64, u64)> {
    crate::elf::ElfFile::open(path).map_or_else(
        |_| Vec::new(),
        |elf| elf.section_ranges(|n| SCANNED.contains(&n.trim_start_matches(".z").trim_start_matches('.'))),
    )
}

/// The page-aligned address ranges inside `m` of the file ranges `sections`.
fn ranges_in(m: &FileMapping, sections: &[(u64, u64)], page: u64) -> Vec<(usize, usize)> {
    let (from, to) = (m.offset, m.offset + (m.end - m.start) as u64);
    sections
        .iter()
        .filter_map(|&(s, e)| {
            let (s, e) = (s.max(from), e.min(to));
            // Whole pages only: a section's first and last pages may hold a neighbour's bytes.
            let (s, e) = (s.next_multiple_of(page), e / page * page);
            (s < e).then(|| (m.start + (s - from) as usize, m.start + (e - from) as usize))
        })
        .collect()
}

/// Runs `f`, which reads the object at `path`, reclaiming the pages of its debug
/// information whenever more than [`RESIDENT_CAP`] of the file is resident meanwhile.
/// Returns what `f` returned and how many ranges were reclaimed.
pub fn bounded<R>(path: &Path, f: impl FnOnce() -> R) -> (R, u64) {
    bounded_at(path, RESIDENT_CAP, f)
}

/// [`bounded`] with a cap of `cap` bytes.
fn bounded_at<R>(path: &Path, cap: u64, f: impl FnOnce() -> R) -> (R, u64) {
    let (Ok(meta), sections) = (std::fs::metadata(path), debug_sections(path)) else {
        return (f(), 0);
    };
    if sections.is_empty() {
        return (f(), 0);
    }
    let (inode, file_len) = (meta.ino(), meta.len());
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let stopped = Arc::clone(&stop);
    let pager = std::thread::Builder::new().name("memtrace-pages".into()).spawn(move || {
        let mut reclaimed = 0u64;
        // The object's resident bytes after the last reclaim.
        let mut floor = 0u64;
        let (lock, wake) = &*stopped;
        let Ok(mut done) = lock.lock() else { return 0 };
        loop {
            // (Checked before waiting too: `f` may be over before this thread first ran.)
            if *done {
                return reclaimed;
            }
            done = match wake.wait_timeout(done, PERIOD) {
                Ok((done, _)) => done,
                Err(_) => return reclaimed,
            };
            if *done {
                return reclaimed;
            }
            let resident = || {
                let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
                let mappings = resident_mappings(&smaps, inode, file_len);
                let bytes = mappings.iter().map(|(_, rss)| rss).sum::<u64>();
                (mappings, bytes)
            };
            let (mappings, bytes) = resident();
            // Past the cap since the last reclaim: the sections left alone may hold more
            // than the cap themselves.
            if bytes <= floor.saturating_add(cap) {
                continue;
            }
            for (m, _) in &mappings {
                for (start, end) in ranges_in(m, &sections, page) {
                    // SAFETY: MADV_PAGEOUT changes no contents: a file page leaves the
                    // page cache (read again from the file when touched), an anonymous
                    // page goes to swap or stays. So even a range unmapped and reused
                    // since the maps were read keeps its data.
                    if unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_PAGEOUT) } == 0 {
                        reclaimed += 1;
                    }
                }
            }
            floor = resident().1;
        }
    });
    let mut pager = Pager { stop: &stop, thread: pager.ok() };
    let out = f();
    let reclaimed = pager.finish();
    (out, reclaimed)
}

/// The pager thread, stopped (and waited for) however `f` ends, a panic included.
struct Pager<'a> {
    stop: &'a (Mutex<bool>, Condvar),
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Pager<'_> {
    /// Stops the thread; how many times it reclaimed pages.
    fn finish(&mut self) -> u64 {
        if let Ok(mut done) = self.stop.0.lock() {
            *done = true;
        }
        self.stop.1.notify_all();
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or(0)
    }
}

impl Drop for Pager<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_give_the_files_read_only_mappings_and_their_resident_bytes() {
        let smaps = "\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1311                       /usr/bin/x
Size:                132 kB
Rss:                 100 kB
VmFlags: rd mr mw me dw sd
55d0c0a21000-55d0c0b00000 r-xp 00021000 fd:01 1311                       /usr/bin/x
Rss:                  12 kB
55d0c0b00000-55d0c0b10000 rw-p 000ff000 fd:01 1311                       /usr/bin/x
Rss:                  64 kB
7f0000000000-7f0010000000 r--s 00000000 103:02 99                        /tmp/big.so
Rss:                2048 kB
7f0010000000-7f0010021000 rw-p 00000000 00:00 0
Rss:                   8 kB
garbage line
";
        // Only mappings of the whole file, from its start.
        assert_eq!(
            resident_mappings(smaps, 1311, 0x21000),
            vec![(FileMapping { start: 0x55d0c0a00000, end: 0x55d0c0a21000, offset: 0, inode: 1311 }, 100 << 10)]
        );
        assert!(resident_mappings(smaps, 1311, 0x22000).is_empty());
        assert_eq!(
            resident_mappings(smaps, 99, 0x1000_0000),
            vec![(FileMapping { start: 0x7f0000000000, end: 0x7f0010000000, offset: 0, inode: 99 }, 2 << 20)]
        );
        assert!(resident_mappings(smaps, 0, 0).is_empty());
    }

    #[test]
    fn section_ranges_become_whole_pages_of_the_mapping() {
        let m = FileMapping { start: 0x10_0000, end: 0x10_8000, offset: 0x2000, inode: 1 };
        // Inside, across the mapping's start, past its end, and less than a page.
        let sections = [(0x3000, 0x4800), (0x1000, 0x2fff), (0x8800, 0x20000), (0x5100, 0x5200)];
        assert_eq!(ranges_in(&m, &sections, 0x1000), vec![(0x10_1000, 0x10_2000), (0x10_7000, 0x10_8000)]);
    }

    /// Resident bytes of the mapping starting at `start`, from smaps.
    fn resident(start: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{start:x}-");
        crate::procfs::smaps_rss(&smaps).find(|(h, _)| h.starts_with(&head)).expect("the mapping is listed").1
    }

    /// A private copy of this test binary (whose debug information only its test maps),
    /// beside it rather than in a temporary directory that may be memory (tmpfs pages do
    /// not leave for a file); removed when dropped.
    struct PrivateCopy(std::path::PathBuf);

    impl PrivateCopy {
        fn new() -> Self {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let exe = std::env::current_exe().unwrap();
            let copy = exe.with_file_name(format!("memtrace-pages-test-{}-{n}", std::process::id()));
            std::fs::copy(&exe, &copy).unwrap();
            Self(copy)
        }
    }

    impl Drop for PrivateCopy {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// Reads the largest debug section of a private copy of this binary inside
    /// `bounded_at(cap)`, waiting for its resident pages to drop under a quarter (at most
    /// `wait` periods); (resident after the read, resident at the end of the wait, ranges
    /// reclaimed). The section reads back whole all the same.
    fn read_a_debug_section(cap: u64, wait: u32) -> (u64, u64, u64) {
        let copy = PrivateCopy::new();
        let path = copy.0.clone();
        let bytes = std::fs::read(&path).unwrap();
        let sections = debug_sections(&path);
        assert!(!sections.is_empty(), "the test binary has debug information");
        let (s, e) = sections.iter().map(|&(s, e)| (s as usize, e as usize)).max_by_key(|(s, e)| e - s).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a read-only mapping of the private copy, unmapped at the end of the test.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let sum = |data: &[u8]| data.iter().step_by(4096).map(|&b| u64::from(b)).sum::<u64>();
        let want = sum(&bytes[s..e]);
        let ((before, during), reclaimed) = bounded_at(&path, cap, || {
            assert_eq!(sum(&map[s..e]), want);
            let before = resident(map.as_ptr() as usize);
            let mut during = before;
            for _ in 0..wait {
                std::thread::sleep(PERIOD);
                during = resident(map.as_ptr() as usize);
                if during < before / 4 {
                    break;
                }
            }
            // Read again whole after its pages were reclaimed.
            assert_eq!(sum(&map[s..e]), want);
            (before, during)
        });
        drop(map);
        drop(copy);
        assert!(before >= (e - s) as u64 / 2, "{before} resident of a {}-byte section read", e - s);
        (before, during, reclaimed)
    }

    #[test]
    fn debug_pages_past_the_cap_are_reclaimed_and_read_again_whole() {
        // A few periods, or longer on a busy machine.
        let (before, during, reclaimed) = read_a_debug_section(1 << 20, 250);
        assert!(reclaimed >= 1, "{reclaimed}");
        assert!(during < before / 4, "{during} of {before} still resident");
    }

    #[test]
    fn debug_pages_under_the_cap_stay() {
        let (before, during, reclaimed) = read_a_debug_section(u64::MAX, 5);
        assert_eq!(reclaimed, 0);
        assert!(during >= before / 2, "{during} of {before} still resident");
    }

    #[test]
    fn an_object_without_debug_information_is_read_without_a_pager() {
        let (out, reclaimed) = bounded(Path::new("/nonexistent/object"), || 7);
        assert_eq!((out, reclaimed), (7, 0));
    }
}
