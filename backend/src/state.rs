//! `--state-dir`: the mux's state on disk, so that a restart, an upgrade or a crash of
//! the daemon loses no connection.
//!
//! # Format: a checksummed journal
//!
//! One file, `DIR/mux.journal`: a 64-byte header (magic, version, the mux's seed and
//! table size, the kernel's boot ID), then frames. A frame is `len: u32`, `crc32: u32`
//! (of the body), and a body of records (`mux::records`). The file starts with one frame
//! holding a snapshot of the whole state; each commit appends one frame with the
//! records of what changed (a changed entry is written whole: 64 bytes).
//!
//! - **Why a journal, not an embedded store:** the state is one table of fixed-size
//!   entries that changes a few entries per MAD, and the daemon already knows exactly
//!   which entries changed. Appending their new values is one `write` per batch of
//!   MADs; a store (sled, redb, SQLite) would add a B-tree, its own journal and a
//!   dependency to get the same result.
//! - **Crash consistency:** a commit is written before any MAD of its batch leaves
//!   (to the wire or to a VM), so the journal never lags what a peer or a VM has seen.
//!   A frame is applied whole or not at all: a torn or corrupt last frame (the crash
//!   happened during its `write`) fails its checksum and is dropped with the batch it
//!   described, whose MADs were never sent. `kill -9` cannot lose a completed `write`
//!   (the page cache has it); losing power loses the VMs too, so commits are not
//!   fsynced (the compacted file is, before it replaces the old one).
//! - **Compaction:** when the journal grows past 4x its last snapshot (and 16 MiB), a
//!   new snapshot goes to `mux.journal.tmp`, is fsynced and renamed over the journal.
//! - **Time:** the daemon's mux clock is CLOCK_MONOTONIC, so stored deadlines stay valid
//!   across processes. After a reboot they would not, and the VMs are gone anyway: a
//!   journal from another boot is set aside (`mux.journal.previous-boot`), not restored.
//! - **One daemon per directory:** `DIR/lock` is held with `flock`.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::files::owner_only;
use crate::mux::{
    Clock, FIRST_FOREIGN_KIND, Mux, MuxConfig, RestoreError, VmConfig, VmId, put_record_parts,
    records,
};

/// The daemon's record: how far a VM's tx ring was consumed (next avail index, then the
/// VM's name), written in the same frame as the mux changes of that batch.
const REC_TX_PROGRESS: u8 = FIRST_FOREIGN_KIND;

fn put_tx_progress(out: &mut Vec<u8>, name: &str, next_avail: u16) {
    put_record_parts(
        out,
        REC_TX_PROGRESS,
        &[&next_avail.to_le_bytes(), name.as_bytes()],
    );
}

fn parse_tx_progress(p: &[u8]) -> Option<(String, u16)> {
    let (idx, name) = p.split_first_chunk::<2>()?;
    Some((
        String::from_utf8_lossy(name).into_owned(),
        u16::from_le_bytes(*idx),
    ))
}

const MAGIC: &[u8; 8] = b"PVCMJNL\x01";
/// The file in `--state-dir` that keeps the VM changes made at runtime
/// ([`crate::runtime::Overlay`]).
pub const OVERLAY_FILE: &str = "vms.toml";
/// Every file the daemon keeps in `--state-dir`: no socket may be put at one of them.
pub const STATE_FILES: [&str; 6] = [
    "lock",
    "mux.journal",
    "mux.journal.tmp",
    "mux.journal.previous-boot",
    OVERLAY_FILE,
    "vms.toml.tmp",
];

/// The state directory's file `path` is, if it is one of [`STATE_FILES`] in `dir`
/// (compared as written, and by the directories' real paths when both exist).
pub fn state_file_at(dir: &Path, path: &Path) -> Option<&'static str> {
    let name = path.file_name()?.to_str()?;
    let file = STATE_FILES.into_iter().find(|f| *f == name)?;
    let parent = match path.parent() {
        Some(p) if p.as_os_str().is_empty() => Path::new("."),
        Some(p) => p,
        None => return None,
    };
    let same = parent == dir
        || matches!(
            (std::fs::canonicalize(parent), std::fs::canonicalize(dir)),
            (Ok(a), Ok(b)) if a == b
        );
    same.then_some(file)
}
const VERSION: u32 = 1;
const HEADER_LEN: usize = 64;
const BOOT_ID_LEN: usize = 36;
const MIN_COMPACT_BYTES: u64 = 16 << 20;
const FRAME_HEAD: usize = 8;

/// Why the state directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// An OS call on the directory or the journal failed.
    #[error("--state-dir {}: {what}: {source}", dir.display())]
    Io {
        /// The directory.
        dir: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Another daemon holds the directory.
    #[error(
        "--state-dir {}: another pvcm-backend uses it (give each daemon its own directory)",
        .0.display()
    )]
    Locked(PathBuf),
    /// The journal is not one this daemon can read.
    #[error(
        "--state-dir {}: {why}; move the file away to start without the old state (every \
         connection it held is then lost)",
        dir.display()
    )]
    Unreadable {
        /// The directory.
        dir: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The journal's records do not make a valid state.
    #[error("--state-dir {}: {source}", dir.display())]
    Restore {
        /// The directory.
        dir: PathBuf,
        /// The error.
        #[source]
        source: RestoreError,
    },
}

/// What [`Journal::open`] found.
#[derive(Debug, Default)]
pub struct Recovery {
    /// The VMs that were attached when the state was written.
    pub attached: Vec<(VmId, VmConfig)>,
    /// Frames applied (the snapshot and the commits after it).
    pub frames: usize,
    /// Bytes dropped at the end (a frame torn by a crash).
    pub torn_bytes: usize,
    /// Live entries restored.
    pub live: u64,
    /// Quarantined IDs restored.
    pub quarantined: u64,
    /// Per VM name: the tx ring's next avail index after the last committed batch.
    pub tx_progress: Vec<(String, u16)>,
}

/// The open journal (see the [module documentation](self)).
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    file: File,
    _lock: File,
    buf: Vec<u8>,
    bytes: u64,
    compact_at: u64,
    boot_id: [u8; BOOT_ID_LEN],
    seed: u64,
    table_bits: u8,
    /// The latest tx progress per VM name (kept for the snapshots).
    tx_progress: std::collections::BTreeMap<String, u16>,
    /// Tx progress records of the batch being committed.
    pending: Vec<u8>,
    /// Commits that could not be written (the log reports the first of each power of 2).
    write_errors: u64,
}

fn boot_id() -> [u8; BOOT_ID_LEN] {
    let mut id = [b'0'; BOOT_ID_LEN];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let b = s.trim().as_bytes();
        let n = b.len().min(BOOT_ID_LEN);
        id[..n].copy_from_slice(&b[..n]);
    }
    id
}

fn header(seed: u64, table_bits: u8, boot: &[u8; BOOT_ID_LEN]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12] = table_bits;
    h[16..24].copy_from_slice(&seed.to_le_bytes());
    h[24..24 + BOOT_ID_LEN].copy_from_slice(boot);
    h
}

/// Frames `body` (records) into `out`.
fn push_frame(out: &mut Vec<u8>, body: &[u8]) {
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    out.extend_from_slice(body);
}

/// The frames of a journal body: each checked body, and how many bytes at the end did
/// not make a whole, checksummed frame.
fn frames(mut buf: &[u8]) -> (Vec<&[u8]>, usize) {
    let mut out = Vec::new();
    loop {
        if buf.len() < FRAME_HEAD {
            return (out, buf.len());
        }
        let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        let crc = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let Some(body) = buf.get(FRAME_HEAD..FRAME_HEAD + len) else {
            return (out, buf.len());
        };
        if crc32fast::hash(body) != crc {
            return (out, buf.len());
        }
        out.push(body);
        buf = &buf[FRAME_HEAD + len..];
    }
}

/// Creates the state directory (mode 0700) if needed and takes its lock: the lock
/// file, held (`flock`) while the returned file is open. Another daemon holding it is
/// [`StateError::Locked`].
fn lock_dir(dir: &Path) -> Result<std::fs::File, StateError> {
    let io = |what: &'static str| {
        let dir = dir.to_path_buf();
        move |source| StateError::Io { dir, what, source }
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io("create"))?;
    let lock = owner_only()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))
        .map_err(io("lock file"))?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(StateError::Locked(dir.to_path_buf()));
        }
        return Err(io("flock")(e));
    }
    Ok(lock)
}

impl Journal {
    /// Opens (creating it if needed) the state directory and returns the journal and the
    /// mux: restored from the journal if there is one from this boot, else new. The
    /// journal is compacted to one snapshot and change tracking is on.
    ///
    /// `cfg.seed` and `cfg.table_bits` are replaced by the journal's when it has state.
    pub fn open<C: Clock>(
        dir: &Path,
        mut cfg: MuxConfig,
        clock: C,
    ) -> Result<(Journal, Mux<C>, Recovery), StateError> {
        let io = |what: &'static str| {
            let dir = dir.to_path_buf();
            move |source| StateError::Io { dir, what, source }
        };
        let lock = lock_dir(dir)?;
        let path = dir.join("mux.journal");
        let boot = boot_id();
        let mut rec = Recovery::default();
        let mut old = Vec::new();
        match owner_only().read(true).open(&path) {
            Ok(mut f) => {
                f.read_to_end(&mut old).map_err(io("read the journal"))?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("open the journal")(e)),
        }
        let unreadable = |why: String| StateError::Unreadable {
            dir: dir.to_path_buf(),
            why,
        };
        let mut bodies = Vec::new();
        if !old.is_empty() {
            if old.len() < HEADER_LEN || &old[..8] != MAGIC {
                return Err(unreadable("mux.journal is not a pvcm journal".into()));
            }
            let version = u32::from_le_bytes([old[8], old[9], old[10], old[11]]);
            if version != VERSION {
                return Err(unreadable(format!(
                    "mux.journal has version {version}; this daemon reads version {VERSION}"
                )));
            }
            if old[24..24 + BOOT_ID_LEN] != boot {
                tracing::warn!(
                    "the state journal is from an earlier boot: its VMs and deadlines are \
                     gone; set aside as mux.journal.previous-boot, starting afresh"
                );
                std::fs::rename(&path, dir.join("mux.journal.previous-boot"))
                    .map_err(io("set the old journal aside"))?;
            } else {
                cfg.table_bits = old[12];
                cfg.seed = u64::from_le_bytes(old[16..24].try_into().unwrap_or([0; 8]));
                let (f, torn) = frames(&old[HEADER_LEN..]);
                rec.frames = f.len();
                rec.torn_bytes = torn;
                bodies = f;
            }
        }
        let mux = if bodies.is_empty() {
            Mux::new(cfg.clone(), clock)
        } else {
            let mut recs = Vec::new();
            for (i, b) in bodies.iter().enumerate() {
                for r in records(b) {
                    let r =
                        r.map_err(|j| unreadable(format!("frame {i}: record {j} is cut short")))?;
                    if r.0 == REC_TX_PROGRESS
                        && let Some((name, idx)) = parse_tx_progress(r.1)
                    {
                        // The last record of each VM wins.
                        match rec.tx_progress.iter_mut().find(|(n, _)| *n == name) {
                            Some(e) => e.1 = idx,
                            None => rec.tx_progress.push((name, idx)),
                        }
                    }
                    recs.push(r);
                }
            }
            let r =
                Mux::restore(cfg.clone(), clock, recs).map_err(|source| StateError::Restore {
                    dir: dir.to_path_buf(),
                    source,
                })?;
            rec.attached = r.attached;
            r.mux
        };
        rec.live = mux.live_entries();
        rec.quarantined = mux.quarantined_entries();
        drop(old);
        let file = owner_only()
            .append(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("open the journal"))?;
        let mut j = Journal {
            dir: dir.to_path_buf(),
            file,
            _lock: lock,
            buf: Vec::new(),
            bytes: 0,
            compact_at: MIN_COMPACT_BYTES,
            boot_id: boot,
            seed: mux.config().seed,
            table_bits: mux.config().table_bits,
            tx_progress: rec.tx_progress.iter().cloned().collect(),
            pending: Vec::new(),
            write_errors: 0,
        };
        let mut mux = mux;
        j.compact(&mux).map_err(io("write the snapshot"))?;
        mux.enable_journal();
        Ok((j, mux, rec))
    }

    /// Notes how far VM `name`'s tx ring was consumed by the batch about to be committed
    /// (see docs/restart.md: a restarted backend does not send those chains again).
    /// Called once per tx batch: allocates nothing once the VM is known.
    pub fn note_tx_progress(&mut self, name: &str, next_avail: u16) {
        put_tx_progress(&mut self.pending, name, next_avail);
        match self.tx_progress.get_mut(name) {
            Some(i) => *i = next_avail,
            None => {
                self.tx_progress.insert(name.to_string(), next_avail);
            }
        }
    }

    /// Writes what changed in `mux` since the last commit (and the noted tx progress),
    /// as one frame. Call it after every batch of mux calls and before any MAD of the
    /// batch leaves.
    pub fn commit<C: Clock>(&mut self, mux: &mut Mux<C>) {
        self.buf.clear();
        self.buf.extend_from_slice(&[0; FRAME_HEAD]);
        let n = mux.journal_changes(&mut self.buf);
        if n == 0 && self.pending.is_empty() {
            return;
        }
        self.buf.extend_from_slice(&self.pending);
        self.pending.clear();
        let len = (self.buf.len() - FRAME_HEAD) as u32;
        let crc = crc32fast::hash(&self.buf[FRAME_HEAD..]);
        self.buf[..4].copy_from_slice(&len.to_le_bytes());
        self.buf[4..8].copy_from_slice(&crc.to_le_bytes());
        match self.file.write_all(&self.buf) {
            Ok(()) => self.bytes += self.buf.len() as u64,
            Err(e) => {
                self.write_errors += 1;
                if self.write_errors.is_power_of_two() {
                    tracing::error!(
                        error = %e,
                        errors = self.write_errors,
                        "cannot write the state journal: a restart now would lose connections"
                    );
                }
                // The next good snapshot makes the journal whole again.
                self.compact_at = 0;
            }
        }
        if self.bytes >= self.compact_at
            && let Err(e) = self.compact(mux)
        {
            self.write_errors += 1;
            tracing::error!(error = %e, "cannot compact the state journal");
        }
    }

    /// Replaces the journal with one snapshot of `mux` (written aside, fsynced, renamed).
    pub fn compact<C: Clock>(&mut self, mux: &Mux<C>) -> io::Result<()> {
        let mut body = Vec::new();
        mux.journal_snapshot(&mut body);
        for (name, idx) in &self.tx_progress {
            put_tx_progress(&mut body, name, *idx);
        }
        let mut out = Vec::with_capacity(HEADER_LEN + FRAME_HEAD + body.len());
        out.extend_from_slice(&header(self.seed, self.table_bits, &self.boot_id));
        push_frame(&mut out, &body);
        let tmp = self.dir.join("mux.journal.tmp");
        let path = self.dir.join("mux.journal");
        let _ = std::fs::remove_file(&tmp);
        let mut f = owner_only().write(true).create_new(true).open(&tmp)?;
        f.write_all(&out)?;
        f.sync_data()?;
        std::fs::rename(&tmp, &path)?;
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        self.file = owner_only().append(true).open(&path)?;
        self.bytes = out.len() as u64;
        self.compact_at = MIN_COMPACT_BYTES.max(4 * self.bytes);
        Ok(())
    }

    /// Flushes the journal to disk (a clean shutdown).
    pub fn sync(&mut self) {
        if let Err(e) = self.file.sync_data() {
            tracing::warn!(error = %e, "state journal fsync");
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mux::{ManualClock, State};
    use pvcm_wire::Gid;
    use pvcm_wire::testing::req;
    use std::fs::OpenOptions;

    fn vm(n: u8) -> VmConfig {
        VmConfig::new(format!("vm{n}"), Gid::from_ipv4([127, 9, 0, n].into()))
    }

    #[test]
    fn frames_stop_at_a_torn_or_corrupt_tail() {
        let mut b = Vec::new();
        push_frame(&mut b, b"one");
        push_frame(&mut b, b"two");
        let whole = b.len();
        push_frame(&mut b, b"three");
        let (f, torn) = frames(&b);
        assert_eq!(f, vec![&b"one"[..], b"two", b"three"]);
        assert_eq!(torn, 0);
        let (f, torn) = frames(&b[..b.len() - 2]);
        assert_eq!(f.len(), 2);
        assert_eq!(torn, b.len() - 2 - whole);
        let mut bad = b.clone();
        let n = bad.len();
        bad[n - 1] ^= 1;
        assert_eq!(frames(&bad).0.len(), 2);
    }

    #[test]
    fn a_reopened_directory_restores_the_state_and_a_torn_commit_is_dropped() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let clock = ManualClock::new();
        let cfg = MuxConfig {
            seed: 77,
            ..MuxConfig::default()
        };
        let peer = Gid::from_ipv4([127, 9, 1, 1].into());
        let (mut j, mut mux, rec) =
            Journal::open(dir.path(), cfg.clone(), clock.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert!(rec.attached.is_empty());
        let a = mux.attach_vm(vm(1)).unwrap_or_else(|e| panic!("{e}"));
        j.commit(&mut mux);
        let v = vm(1);
        let mut m = req(v.gid, v.ca_guid, 0x11, 1, peer, 0x10001);
        let _ = mux.from_guest(a, &mut m, peer);
        j.commit(&mut mux);
        let pv = mux.pv_cm_id_of(a, 0x11).unwrap_or_else(|| panic!("no pv"));
        // A second daemon on the same directory is refused.
        let second = Journal::open(dir.path(), cfg.clone(), clock.clone());
        assert!(matches!(second, Err(StateError::Locked(_))), "{second:?}");
        // A commit cut short by a crash: the second REQ's frame loses its last bytes.
        let mut m2 = req(v.gid, v.ca_guid, 0x12, 2, peer, 0x10002);
        let _ = mux.from_guest(a, &mut m2, peer);
        j.commit(&mut mux);
        let path = dir.path().join("mux.journal");
        let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        drop(j);
        let f = OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{e}"));
        f.set_len(len - 3).unwrap_or_else(|e| panic!("{e}"));
        drop(f);
        let (_j, mux2, rec) = Journal::open(dir.path(), MuxConfig::default(), clock)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rec.attached.len(), 1);
        assert_eq!(rec.attached[0].0, a);
        assert!(rec.torn_bytes > 0);
        assert_eq!(mux2.config().seed, 77, "the journal's seed wins");
        assert_eq!(mux2.pv_cm_id_of(a, 0x11), Some(pv));
        assert_eq!(mux2.lookup(pv), Some((State::ReqSent, Some(a))));
        assert_eq!(
            mux2.pv_cm_id_of(a, 0x12),
            None,
            "the torn commit is dropped"
        );
        assert_eq!(mux2.live_entries(), 1);
    }

    #[test]
    fn tx_ring_positions_go_with_their_frame_and_survive_a_compaction() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let clock = ManualClock::new();
        let (mut j, mut mux, _) = Journal::open(dir.path(), MuxConfig::default(), clock.clone())
            .unwrap_or_else(|e| panic!("{e}"));
        // A batch with no mux change still commits its position.
        j.note_tx_progress("vm1", 7);
        j.commit(&mut mux);
        j.note_tx_progress("vm1", 65_535);
        j.commit(&mut mux);
        j.compact(&mux).unwrap_or_else(|e| panic!("{e}"));
        j.note_tx_progress("vm2", 3);
        j.commit(&mut mux);
        drop(j);
        let (_j, _m, rec) = Journal::open(dir.path(), MuxConfig::default(), clock)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut p = rec.tx_progress.clone();
        p.sort();
        assert_eq!(p, vec![("vm1".to_string(), 65_535), ("vm2".to_string(), 3)]);
    }
}
