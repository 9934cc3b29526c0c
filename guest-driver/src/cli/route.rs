//! What `pvcm-guest`'s commands need of the CM, whichever way they reach it.
//!
//! [`Route`] is implemented twice: by the device route ([`super::device_route`]: the
//! CLI drives the pvcm device and its CM agent itself) and by the service route
//! ([`super::via_service`]: an rdma_cm application of pvcm-guestd's device node). The
//! commands in [`super::commands`] are written once over it.

use std::fmt::Display;
use std::time::Duration;

use pvcm_wire::Gid;
use serde_json::Value;

use super::Report;
use crate::cm::RejReason;
use crate::device::DeviceEvent;
use crate::device::cmtime::{ClientOptions, CmtimeReport, Failure, ServerOptions, ServerReport};
use crate::time::Time;

/// An event a command sees, in the same terms on both routes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteEvent<Id> {
    /// Something happened to the pvcm device (device route only).
    Device(DeviceEvent),
    /// A connection request for a listener.
    ConnectRequest {
        /// The new connection.
        id: Id,
        /// The listener it came to, when the route names it.
        listen_id: Option<Id>,
        /// The peer's address, as the lines print it.
        remote_gid: String,
        /// The peer's QPN.
        remote_qpn: u32,
        /// The user part of the request's private data, as text.
        data: String,
    },
    /// A connection is established.
    Established {
        /// The connection.
        id: Id,
        /// The peer's QPN.
        remote_qpn: u32,
        /// The user part of the answer's private data, as text.
        data: String,
    },
    /// The connection was disconnected.
    Disconnected {
        /// The connection.
        id: Id,
    },
    /// The peer rejected the connection.
    Rejected {
        /// The connection.
        id: Id,
        /// The REJ's reason.
        reason: RejReason,
    },
    /// The peer did not answer any retry.
    Unreachable {
        /// The connection.
        id: Id,
    },
    /// Any other event of a connection.
    Other {
        /// The connection.
        id: Id,
    },
}

impl<Id: Copy> RouteEvent<Id> {
    /// The connection it is about (`None`: a device event).
    pub fn id(&self) -> Option<Id> {
        match self {
            RouteEvent::Device(_) => None,
            RouteEvent::ConnectRequest { id, .. }
            | RouteEvent::Established { id, .. }
            | RouteEvent::Disconnected { id }
            | RouteEvent::Rejected { id, .. }
            | RouteEvent::Unreachable { id }
            | RouteEvent::Other { id } => Some(*id),
        }
    }
}

/// How answering a connection request went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The answer went out.
    Sent,
    /// The peer withdrew the request before the answer (e.g. `rdma_connect()` then
    /// `rdma_destroy_id()`: its REJ(TIMEOUT) came first).
    Withdrawn {
        /// Why, for the text line.
        why: String,
        /// The `state` field of the JSON line.
        state: String,
        /// The request is over for the route (no event about it follows): the command
        /// destroys it and counts it at once.
        ended: bool,
    },
}

/// What `connect` was asked to do.
#[derive(Debug, Clone, Copy)]
pub struct ConnectArgs<'a> {
    /// The server's GID.
    pub dest: Gid,
    /// The server's port.
    pub port: u16,
    /// Private data after rdma_cm's header.
    pub data: &'a str,
    /// How long to wait for each answer.
    pub timeout: Duration,
    /// How long to stay connected.
    pub hold: Duration,
    /// The source port of a bound id.
    pub src_port: Option<u16>,
}

/// An established connection, as `connect` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connected {
    /// The peer's QPN.
    pub remote_qpn: u32,
    /// The user part of the REP's private data, as text.
    pub data: String,
    /// The source port rdma_cm's header named.
    pub src_port: u16,
}

/// A connection attempt's end: the connection, and whether it is established or why
/// not.
pub type Attempt<Id> = (Id, Result<Connected, Failure>);

/// The operations `pvcm-guest`'s commands need of the CM.
pub trait Route {
    /// A connection's (or listener's) handle; its `Display` is how the lines name it.
    type Id: Copy + Eq + Display;
    /// Why an operation could not run (exit status 1).
    type Error;
    /// Where a work line (`cmtime`'s last line) starts counting.
    type Mark;

    /// This VM's GID.
    fn gid(&self) -> Gid;
    /// The current time on the route's clock.
    fn now(&self) -> Time;
    /// The next event, waiting for it until `until` (`None`: no event came).
    fn next(&mut self, until: Time) -> Result<Option<RouteEvent<Self::Id>>, Self::Error>;
    /// Listens on an rdma_cm TCP port.
    fn listen(&mut self, port: u16) -> Result<Self::Id, Self::Error>;
    /// Ends `listen`: what the route does when the command is done with `listener`.
    fn stop_listening(&mut self, listener: Self::Id) -> Result<(), Self::Error>;
    /// Accepts a connection request with this private data.
    fn accept(&mut self, id: Self::Id, private_data: &[u8]) -> Result<Answer, Self::Error>;
    /// Rejects a connection request (consumer-defined) with this private data.
    fn reject(&mut self, id: Self::Id, private_data: &[u8]) -> Result<Answer, Self::Error>;
    /// Starts a connection and waits (up to `a.timeout`) for the end of its handshake:
    /// the connection, and whether it is established or why not. Device events met
    /// on the way are printed to `rep`.
    fn connect(
        &mut self,
        rep: &mut dyn Report,
        a: &ConnectArgs<'_>,
    ) -> Result<Attempt<Self::Id>, Self::Error>;
    /// Gives up on a connection whose attempt failed (destroying it sends what the CM
    /// sends for it).
    fn abandon(&mut self, id: Self::Id) -> Result<(), Self::Error>;
    /// Disconnects a connection (DREQ).
    fn disconnect(&mut self, id: Self::Id) -> Result<(), Self::Error>;
    /// Destroys a connection.
    fn destroy(&mut self, id: Self::Id) -> Result<(), Self::Error>;
    /// Lets what the last calls queued go out before the command ends.
    fn flush(&mut self) -> Result<(), Self::Error>;
    /// Waits `d` between `cmtime` rounds.
    fn pause(&mut self, d: Duration) -> Result<(), Self::Error>;
    /// Starts counting the route's work for a work line.
    fn mark(&mut self, server: bool) -> Result<Self::Mark, Self::Error>;
    /// The work line (text, JSON) since `since`.
    fn work(&mut self, since: Self::Mark) -> Result<(String, Value), Self::Error>;
    /// One `cmtime` client burst.
    fn cmtime_client(&mut self, o: &ClientOptions) -> Result<CmtimeReport, Self::Error>;
    /// A `cmtime` server run.
    fn cmtime_server(&mut self, o: &ServerOptions) -> Result<ServerReport, Self::Error>;
}
