//! Creating the recording file safely: mode 0600 (it names other users' code and
//! addresses), never through a symlink, and overwriting only a previous recording unless
//! `--force`.
use std::{
    fs::{self, File, OpenOptions},
    io::{self, Read},
    os::unix::fs::{FileTypeExt, OpenOptionsExt},
    path::Path,
};

use anyhow::{Context as _, Result, bail};

use crate::recording::MAGIC;

fn is_recording(path: &Path) -> bool {
    let mut magic = [0u8; 8];
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|()| &magic == MAGIC)
}

/// Creates `path` for writing a recording.
pub fn create(path: &Path, force: bool) -> Result<File> {
    match fs::symlink_metadata(path) {
        Ok(meta) => {
            let kind = meta.file_type();
            if kind.is_dir() {
                bail!("{} is a directory", path.display());
            }
            let replaceable = force || (kind.is_file() && is_recording(path));
            if !replaceable {
                let what = if kind.is_symlink() {
                    "is a symbolic link"
                } else if kind.is_file() {
                    "exists and is not a memtrace recording"
                } else if kind.is_fifo() || kind.is_socket() || kind.is_char_device() || kind.is_block_device() {
                    "is not a regular file"
                } else {
                    "exists"
                };
                bail!("{} {what}; use --force to replace it", path.display());
            }
            // Unlinking removes a symlink itself, never its target.
            fs::remove_file(path).with_context(|| format!("replacing {}", path.display()))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    // O_EXCL fails if anything (a symlink included) appeared in the meantime.
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn tempdir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "memtrace-output-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn creates_private_files_and_replaces_only_recordings() {
        let dir = tempdir();
        let out = dir.join("memtrace.data");
        drop(create(&out, false).unwrap());
        assert_eq!(fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o600);
        // An empty file is not a recording.
        assert!(create(&out, false).unwrap_err().to_string().contains("not a memtrace recording"));
        fs::write(&out, b"MEMTRACE\x01\x00").unwrap();
        drop(create(&out, false).unwrap());
        fs::write(&out, b"precious").unwrap();
        drop(create(&out, true).unwrap());
        assert_eq!(fs::read(&out).unwrap(), b"");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn never_writes_through_a_symlink() {
        let dir = tempdir();
        let victim = dir.join("victim");
        fs::write(&victim, b"MEMTRACE keep me").unwrap();
        let link = dir.join("memtrace.data");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let err = create(&link, false).unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        drop(create(&link, true).unwrap());
        assert_eq!(fs::read(&victim).unwrap(), b"MEMTRACE keep me");
        assert!(!fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        fs::remove_dir_all(&dir).unwrap();
    }
}
