//! The service's last moments after a stop: what its callers' files answer until they
//! are closed.
//!
//! When the service stops, its callers' files cannot live on (their ids are released,
//! their connections end: [`super::server`]). The kernel fails the calls made on the
//! files of a CUSE device whose server is gone, but answers their `poll()` with
//! POLLERR alone, never POLLIN: a program that waits for its event channel with
//! `poll()` and reads it only on POLLIN (rping 59 and later, most event loops) never
//! reads the error, and runs on, or spins on the POLLERR. So the service does not
//! vanish at once: it wakes every armed poller, fails every blocked GET_EVENT with
//! ENODEV, and then, for [`CLOSE_GRACE`] at most, answers a poll "readable" (POLLIN
//! with POLLERR), any command ENODEV (the read that follows a readable poll fails, as
//! `rdma_get_cm_event()` fails on a device that is gone), an open ENODEV, and a
//! release with its acknowledgement. It exits as soon as every file open at the stop
//! has been released, or when the grace ends, whichever comes first.
//!
//! A service killed outright (SIGKILL, a crash) cannot do this: FUSE's abort does not
//! wake a file's pollers, so such a program waits on until something else wakes it.

use std::io;
use std::time::{Duration, Instant};

use super::cma::errno;
use super::cuse::{CuseDev, READ_BUFFER, Reply, Request};
use crate::transport::poll_readable;

/// How long the service keeps answering its callers' files after a stop.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The files of a stopped service, answered until they are released.
#[derive(Debug)]
pub struct Closing {
    /// Files open at the stop and not yet released (CUSE sends one RELEASE per file
    /// it opened; files opened after the stop fail to open and send none).
    open: usize,
    /// When the service exits whatever is still open.
    until: Instant,
    /// Requests answered while closing.
    pub answered: u64,
}

impl Closing {
    /// Closing `open` files, until `now + grace` at most.
    pub fn new(open: usize, now: Instant, grace: Duration) -> Closing {
        Closing {
            open,
            until: now + grace,
            answered: 0,
        }
    }

    /// The service may exit: every file is released, or the grace is over.
    pub fn done(&self, now: Instant) -> bool {
        self.open == 0 || now >= self.until
    }

    /// How long is left of the grace.
    pub fn left(&self, now: Instant) -> Duration {
        self.until.saturating_duration_since(now)
    }

    /// How many files are still open.
    pub fn still_open(&self) -> usize {
        self.open
    }

    /// The answer to one request read from CUSE while closing (`None`: none is due,
    /// an INTERRUPT).
    pub fn answer(&mut self, b: &[u8]) -> Option<Reply> {
        self.answered += 1;
        let Ok((h, r)) = Request::parse(b) else {
            return Reply::to_unreadable(b, errno::EINVAL);
        };
        Some(match r {
            Request::Poll { .. } => Reply::poll(
                h.unique,
                (libc::POLLIN | libc::POLLRDNORM | libc::POLLERR) as u32,
            ),
            Request::Release { .. } => {
                self.open = self.open.saturating_sub(1);
                Reply::empty(h.unique)
            }
            Request::Interrupt { .. } => return None,
            Request::Open { .. } | Request::Write { .. } | Request::Ioctl { .. } => {
                Reply::error(h.unique, errno::ENODEV)
            }
            Request::Init { .. } | Request::Read { .. } => Reply::error(h.unique, errno::EINVAL),
            Request::Other(_) => Reply::error(h.unique, errno::ENOSYS),
        })
    }
}

/// Answers `cuse`'s requests as `closing` says until it is done.
pub fn serve(cuse: &CuseDev, closing: &mut Closing) -> io::Result<()> {
    cuse.set_blocking(false)?;
    let mut buf = vec![0u8; READ_BUFFER];
    while !closing.done(Instant::now()) {
        poll_readable(&[], &[cuse.fd()], closing.left(Instant::now()))?;
        while let Some(n) = cuse.read(&mut buf)? {
            if let Some(r) = closing.answer(&buf[..n]) {
                cuse.write(r.bytes())?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::cma::Fh;
    use crate::service::cuse::{op, request_bytes};

    /// (error, unique, the first argument word) of an answer.
    fn read(r: &Reply) -> (i32, u64, Option<u32>) {
        let b = r.bytes();
        let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let unique = u64::from_le_bytes(b[8..16].try_into().unwrap());
        (word(4) as i32, unique, (b.len() >= 20).then(|| word(16)))
    }

    fn with_fh(fh: Fh, rest: usize) -> Vec<u8> {
        let mut a = vec![0u8; 8 + rest];
        a[0..8].copy_from_slice(&fh.to_le_bytes());
        a
    }

    #[test]
    fn a_poll_is_readable_and_a_command_fails_with_enodev() {
        let t = Instant::now();
        let mut c = Closing::new(2, t, CLOSE_GRACE);
        let poll = c
            .answer(&request_bytes(op::POLL, 7, &with_fh(3, 16)))
            .unwrap();
        let (err, unique, revents) = read(&poll);
        assert_eq!((err, unique), (0, 7));
        let revents = revents.unwrap();
        // What a program waiting for POLLIN needs, to go and read the error.
        assert_ne!(revents & libc::POLLIN as u32, 0);
        assert_ne!(revents & libc::POLLERR as u32, 0);
        let mut w = with_fh(3, 32 + 8);
        w[16..20].copy_from_slice(&8u32.to_le_bytes());
        let write = c.answer(&request_bytes(op::WRITE, 8, &w)).unwrap();
        assert_eq!(read(&write).0, -libc::ENODEV);
        let open = c.answer(&request_bytes(op::OPEN, 9, &[0; 8])).unwrap();
        assert_eq!(read(&open).0, -libc::ENODEV);
        assert!(
            c.answer(&request_bytes(op::INTERRUPT, 10, &[0; 8]))
                .is_none()
        );
        assert_eq!(c.answered, 4);
    }

    #[test]
    fn it_ends_when_every_file_is_released_or_the_grace_is_over() {
        let t = Instant::now();
        let mut c = Closing::new(2, t, CLOSE_GRACE);
        assert!(!c.done(t));
        let r = c.answer(&request_bytes(op::RELEASE, 11, &with_fh(3, 16)));
        assert_eq!(r.map(|r| read(&r).0), Some(0));
        assert_eq!(c.still_open(), 1);
        assert!(!c.done(t + CLOSE_GRACE / 2));
        assert!(c.done(t + CLOSE_GRACE));
        c.answer(&request_bytes(op::RELEASE, 14, &with_fh(4, 16)));
        assert!(c.done(t));
        // One more release (none is due) does not wrap around.
        c.answer(&request_bytes(op::RELEASE, 15, &with_fh(5, 16)));
        assert_eq!(c.still_open(), 0);
        assert!(Closing::new(0, t, CLOSE_GRACE).done(t));
    }

    #[test]
    fn a_request_it_cannot_read_is_answered_when_it_names_itself() {
        let mut c = Closing::new(1, Instant::now(), CLOSE_GRACE);
        let mut b = request_bytes(op::WRITE, 21, &[0; 4]);
        let r = c.answer(&b).unwrap();
        assert_eq!(read(&r).0, -libc::EINVAL);
        assert_eq!(read(&r).1, 21);
        b.truncate(12);
        assert!(c.answer(&b).is_none());
    }
}
