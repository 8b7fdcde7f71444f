//! Bounding the resident pages of a big object while the symbolizer reads it in place.
//!
//! blazesym maps an object whole and parses its DWARF from the mapping. Each fault on a
//! file mapping maps up to 64 KiB of pages around it that the page cache holds (the
//! kernel's fault-around), and mapped pages stay in the resident set until the mapping
//! goes: reading the unit headers of libtriton's 141 MB of `.debug_info` (it has no
//! `.debug_aranges`) left 129 MB of it resident, the peak of a PyTorch recording. While a
//! big object is symbolized, [`bounded`] drops the page-table entries of the mappings of
//! that file made since it began, every [`PERIOD`]: the pages stay in the page cache, and a
//! later read maps them again (a minor fault).

use std::{
    os::unix::fs::MetadataExt,
    path::Path,
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

/// How often the pages are handed back.
const PERIOD: Duration = Duration::from_millis(20);

/// A read-only mapping of a file: its range and the file's device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileMapping {
    start: usize,
    end: usize,
    dev: (u32, u32),
    inode: u64,
}

/// The read-only file mappings of a `/proc/PID/maps` text.
fn read_only_file_mappings(maps: &str) -> Vec<FileMapping> {
    maps.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (range, perms, _offset, dev, inode) =
                (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
            if !perms.starts_with("r-") {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let (major, minor) = dev.split_once(':')?;
            let inode = inode.parse::<u64>().ok().filter(|&i| i != 0)?;
            Some(FileMapping {
                start: usize::from_str_radix(start, 16).ok()?,
                end: usize::from_str_radix(end, 16).ok()?,
                dev: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
                inode,
            })
        })
        .collect()
}

/// This process's read-only mappings of the file `(dev, inode)`.
fn mappings_of(dev: (u32, u32), inode: u64) -> Vec<FileMapping> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    read_only_file_mappings(&maps).into_iter().filter(|m| m.dev == dev && m.inode == inode).collect()
}

/// Runs `f`, which maps the file at `path` (and keeps every mapping of it it makes until
/// after it returns), handing back the resident pages of those mappings every [`PERIOD`].
/// Mappings of the file that existed before are left alone. Returns what `f` returned and
/// how many times pages were handed back.
pub fn bounded<R>(path: &Path, f: impl FnOnce() -> R) -> (R, u64) {
    let Ok(meta) = std::fs::metadata(path) else {
        return (f(), 0);
    };
    let dev = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let inode = meta.ino();
    let before = mappings_of(dev, inode);
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let stopped = Arc::clone(&stop);
    let pager = std::thread::Builder::new().name("memtrace-pages".into()).spawn(move || {
        let mut handed_back = 0u64;
        let (lock, wake) = &*stopped;
        let Ok(mut done) = lock.lock() else { return 0 };
        loop {
            // (Checked before waiting too: `f` may be over before this thread first ran.)
            if *done {
                return handed_back;
            }
            done = match wake.wait_timeout(done, PERIOD) {
                Ok((done, _)) => done,
                Err(_) => return handed_back,
            };
            if *done {
                return handed_back;
            }
            for m in mappings_of(dev, inode).into_iter().filter(|m| !before.contains(m)) {
                // SAFETY: `m` is a read-only mapping of the file that `f` made after
                // `bounded` began, and `f` keeps it until `bounded` returns, which is
                // after this thread ends (the lock is held across this call, and the
                // caller takes it to stop us): the range cannot have been unmapped and
                // reused for other memory. On a read-only file mapping MADV_DONTNEED only
                // drops page-table entries; the contents are the file's, mapped again from
                // the page cache at the next read.
                if unsafe { libc::madvise(m.start as *mut libc::c_void, m.end - m.start, libc::MADV_DONTNEED) } == 0 {
                    handed_back += 1;
                }
            }
        }
    });
    let out = f();
    if let Ok(mut done) = stop.0.lock() {
        *done = true;
    }
    stop.1.notify_all();
    let handed_back = pager.ok().and_then(|t| t.join().ok()).unwrap_or(0);
    (out, handed_back)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn maps_lines_give_read_only_file_mappings() {
        let maps = "\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1311                       /usr/bin/x
55d0c0a21000-55d0c0b00000 r-xp 00021000 fd:01 1311                       /usr/bin/x
55d0c0b00000-55d0c0b10000 rw-p 000ff000 fd:01 1311                       /usr/bin/x
7f0000000000-7f0010000000 r--s 00000000 103:02 99                        /tmp/big.so
7f0010000000-7f0010021000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 r--p 00000000 00:00 0                          [vvar]
garbage line
";
        assert_eq!(
            read_only_file_mappings(maps),
            vec![
                FileMapping { start: 0x55d0c0a00000, end: 0x55d0c0a21000, dev: (0xfd, 1), inode: 1311 },
                FileMapping { start: 0x55d0c0a21000, end: 0x55d0c0b00000, dev: (0xfd, 1), inode: 1311 },
                FileMapping { start: 0x7f0000000000, end: 0x7f0010000000, dev: (0x103, 2), inode: 99 },
            ]
        );
    }

    /// Resident bytes of the mapping starting at `start`, from smaps.
    fn resident(start: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{start:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
        lines.next().expect("the mapping is listed");
        let rss = lines.find_map(|l| l.strip_prefix("Rss:")).unwrap();
        rss.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
    }

    struct Mapped(*mut u8, usize);

    impl Mapped {
        fn new(file: &std::fs::File, len: usize) -> Self {
            use std::os::fd::AsRawFd;
            // SAFETY: a fresh read-only shared mapping of the whole file.
            let p = unsafe {
                libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0)
            };
            assert_ne!(p, libc::MAP_FAILED);
            Self(p.cast(), len)
        }

        /// Reads a byte of every page; their sum.
        fn touch(&self) -> u64 {
            // SAFETY: the mapping is `self.1` bytes long and lives as long as `self`.
            (0..self.1).step_by(4096).map(|i| u64::from(unsafe { self.0.add(i).read_volatile() })).sum()
        }
    }

    impl Drop for Mapped {
        fn drop(&mut self) {
            // SAFETY: what mmap returned.
            unsafe { libc::munmap(self.0.cast(), self.1) };
        }
    }

    #[test]
    fn pages_of_new_mappings_are_handed_back_and_read_again_whole() {
        let len = 8 << 20;
        let path = std::env::temp_dir().join(format!("memtrace-pages-{}", std::process::id()));
        let bytes: Vec<u8> = (0..len).map(|i| (i / 4096 % 251) as u8).collect();
        std::fs::File::create(&path).unwrap().write_all(&bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let want: u64 = (0..len).step_by(4096).map(|i| u64::from(bytes[i])).sum();
        let earlier = Mapped::new(&file, len);
        assert_eq!(earlier.touch(), want);
        let ((mapped, during), handed_back) = bounded(&path, || {
            let mapped = Mapped::new(&file, len);
            assert_eq!(mapped.touch(), want);
            assert_eq!(resident(mapped.0 as usize), len as u64);
            // A few periods, or longer on a busy machine.
            let mut during = len as u64;
            for _ in 0..250 {
                std::thread::sleep(PERIOD);
                during = resident(mapped.0 as usize);
                if during < len as u64 / 4 {
                    break;
                }
            }
            // Read again whole after its pages were handed back.
            assert_eq!(mapped.touch(), want);
            (mapped, during)
        });
        assert!(handed_back >= 1, "{handed_back}");
        assert!(during < len as u64 / 4, "{during} of {len} still resident");
        // The mapping made before was left alone.
        assert_eq!(resident(earlier.0 as usize), len as u64);
        drop(mapped);
        let _ = std::fs::remove_file(&path);
    }
}
