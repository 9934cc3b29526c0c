//! The device route: `pvcm-guest`'s commands on a [`Device`] the CLI drives itself (the
//! user-space virtio-pci driver, or a lab device in `pvcm-lab attach`).

use std::time::Duration;

use serde_json::{Value, json};

use super::commands::wait_for;
use super::pd_text;
use super::route::{Answer, Attempt, ConnectArgs, Connected, Route, RouteEvent};
use crate::cm::rdma_cm::{CmaHdr, EphemeralPorts, req_private_data, tcp_service_id};
use crate::cm::{CmError, CmId, ConnectOptions, Event};
use crate::device::cmtime::{
    self, ClientOptions, CmtimeReport, Failure, ServerOptions, ServerReport,
};
use crate::device::{Device, DeviceError, DeviceStats, Notice, Transport};
use crate::time::{Clock, Time};
use pvcm_wire::Gid;

/// How long the device route lets queued MADs go out before a command ends.
const FLUSH: Duration = Duration::from_secs(1);

/// [`Route`] on a started device.
#[derive(Debug)]
pub struct DeviceRoute<'d, T: Transport, C: Clock> {
    dev: &'d mut Device<T, C>,
}

impl<'d, T: Transport, C: Clock> DeviceRoute<'d, T, C> {
    /// The route through `dev`.
    pub fn new(dev: &'d mut Device<T, C>) -> Self {
        DeviceRoute { dev }
    }

    /// The source port of an rdma_cm id: the bound one, else an ephemeral one as
    /// rdma_cm picks (`cma_alloc_any_port()`).
    pub fn source_port(&self, bound: Option<u16>) -> u16 {
        bound
            .or_else(|| {
                EphemeralPorts::new(self.dev.options().seed ^ u64::from(std::process::id())).alloc()
            })
            .unwrap_or(0)
    }

    fn answered(r: Result<(), CmError>) -> Result<Answer, DeviceError> {
        match r {
            Ok(()) => Ok(Answer::Sent),
            // Its Rejected event follows.
            Err(CmError::InvalidState(state)) => Ok(Answer::Withdrawn {
                why: format!("state {state}"),
                state: state.to_string(),
                ended: false,
            }),
            Err(e) => Err(e.into()),
        }
    }
}

/// The agent's event in the commands' terms.
fn route_event(e: Event) -> RouteEvent<CmId> {
    match e {
        Event::ConnectRequest {
            id,
            listen_id,
            remote_gid,
            remote_qpn,
            private_data,
            ..
        } => RouteEvent::ConnectRequest {
            id,
            listen_id: Some(listen_id),
            remote_gid: remote_gid.to_string(),
            remote_qpn,
            data: pd_text(&private_data, true),
        },
        Event::Established {
            id,
            remote_qpn,
            private_data,
            ..
        } => RouteEvent::Established {
            id,
            remote_qpn,
            data: pd_text(&private_data, false),
        },
        Event::Disconnected { id } => RouteEvent::Disconnected { id },
        Event::Rejected { id, reason, .. } => RouteEvent::Rejected { id, reason },
        Event::Unreachable { id } => RouteEvent::Unreachable { id },
        e => RouteEvent::Other { id: e.id() },
    }
}

impl<T: Transport, C: Clock> Route for DeviceRoute<'_, T, C> {
    type Id = CmId;
    type Error = DeviceError;
    type Mark = DeviceStats;

    fn gid(&self) -> Gid {
        self.dev.agent().config().gid
    }

    fn now(&self) -> Time {
        self.dev.now()
    }

    fn next(&mut self, until: Time) -> Result<Option<RouteEvent<CmId>>, DeviceError> {
        let left = until.since(self.dev.now());
        if left.is_zero() {
            return Ok(None);
        }
        Ok(self.dev.next_notice(left)?.map(|n| match n {
            Notice::Device(e) => RouteEvent::Device(e),
            Notice::Cm(e) => route_event(e),
        }))
    }

    fn listen(&mut self, port: u16) -> Result<CmId, DeviceError> {
        Ok(self.dev.listen(tcp_service_id(port))?)
    }

    /// The listener lives until the process ends; what the last answers queued goes
    /// out.
    fn stop_listening(&mut self, _listener: CmId) -> Result<(), DeviceError> {
        self.flush()
    }

    fn accept(&mut self, id: CmId, private_data: &[u8]) -> Result<Answer, DeviceError> {
        Self::answered(self.dev.accept(id, private_data))
    }

    fn reject(&mut self, id: CmId, private_data: &[u8]) -> Result<Answer, DeviceError> {
        Self::answered(self.dev.reject(id, private_data))
    }

    fn connect(
        &mut self,
        rep: &mut dyn super::Report,
        a: &ConnectArgs<'_>,
    ) -> Result<Attempt<CmId>, DeviceError> {
        let sport = self.source_port(a.src_port);
        let pd = req_private_data(
            &CmaHdr::from_gids(self.gid(), a.dest, sport),
            a.data.as_bytes(),
        )
        .map_err(|e| DeviceError::Invalid(format!("private data: {e}")))?;
        let sid = tcp_service_id(a.port);
        let id = self
            .dev
            .connect(a.dest, sid, &pd, &ConnectOptions::default())?;
        let first = wait_for(self, rep, id, a.timeout, |e| {
            matches!(
                e,
                RouteEvent::Established { .. }
                    | RouteEvent::Rejected { .. }
                    | RouteEvent::Unreachable { .. }
            )
        })?;
        let outcome = match first {
            Some(RouteEvent::Established {
                remote_qpn, data, ..
            }) => Ok(Connected {
                remote_qpn,
                data,
                src_port: sport,
            }),
            Some(RouteEvent::Rejected { reason, .. }) => Err(Failure::Rejected(reason)),
            Some(RouteEvent::Unreachable { .. }) => Err(Failure::Unreachable),
            _ => Err(Failure::Timeout),
        };
        Ok((id, outcome))
    }

    fn abandon(&mut self, id: CmId) -> Result<(), DeviceError> {
        // Destroying an unknown handle (after a reset) is fine to ignore.
        let _ = self.dev.destroy(id);
        self.flush()
    }

    fn disconnect(&mut self, id: CmId) -> Result<(), DeviceError> {
        Ok(self.dev.disconnect(id)?)
    }

    fn destroy(&mut self, id: CmId) -> Result<(), DeviceError> {
        Ok(self.dev.destroy(id)?)
    }

    fn flush(&mut self) -> Result<(), DeviceError> {
        self.dev.flush(FLUSH)?;
        Ok(())
    }

    /// The device keeps being served meanwhile.
    fn pause(&mut self, d: Duration) -> Result<(), DeviceError> {
        self.dev.run_until(d, |_| false)?;
        Ok(())
    }

    /// A server's work line counts the device's work since the device started.
    fn mark(&mut self, server: bool) -> Result<DeviceStats, DeviceError> {
        Ok(if server {
            DeviceStats::default()
        } else {
            *self.dev.stats()
        })
    }

    /// How the device's queues were worked: messages per notification and per sleep
    /// are what a VM pays for in exits and interrupts.
    fn work(&mut self, since: DeviceStats) -> Result<(String, Value), DeviceError> {
        let (now, b) = (self.dev.stats(), since);
        let rx_msgs = now.rx_msgs - b.rx_msgs;
        let tx_mads = now.tx_mads - b.tx_mads;
        let tx_batches = now.tx_batches - b.tx_batches;
        let tx_kicks = now.tx_kicks - b.tx_kicks;
        let rx_kicks = now.rx_kicks - b.rx_kicks;
        let waits = now.waits - b.waits;
        Ok((
            format!(
                "device rx {rx_msgs} tx {tx_mads} in {tx_batches} batches, kicks tx {tx_kicks} rx {rx_kicks}, waits {waits}"
            ),
            json!({"event": "device", "rx_msgs": rx_msgs, "tx_mads": tx_mads,
                "tx_batches": tx_batches, "tx_kicks": tx_kicks, "rx_kicks": rx_kicks,
                "waits": waits}),
        ))
    }

    fn cmtime_client(&mut self, o: &ClientOptions) -> Result<CmtimeReport, DeviceError> {
        cmtime::client(self.dev, o)
    }

    fn cmtime_server(&mut self, o: &ServerOptions) -> Result<ServerReport, DeviceError> {
        cmtime::server(self.dev, o)
    }
}
