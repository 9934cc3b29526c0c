//! The guest CM service (`pvcm-guestd`): the Linux kernel's rdma_cm character device
//! served in user space, so the distribution's librdmacm and the programs on it run
//! unchanged in a pvcm VM, their CM carried by the pvcm device.
//!
//! - [`cuse`]: the CUSE protocol (the device node, requests and replies, poll
//!   notifications) on `/dev/cuse`.
//! - [`abi`]: the rdma_cm command ABI (`rdma_user_cm.h`).
//! - [`caller`]: the calling process's memory, where answers go.
//! - [`verbs`]: the VM's own RDMA device (the one whose GID is the pvcm GID), as
//!   rdma_cm names it to librdmacm.
//! - [`netlink`]: netlink sockets, messages and attributes, for [`nldev`] and
//!   [`neigh`].
//! - [`nldev`]: the RDMA devices the kernel has registered (RDMA netlink).
//! - [`cma`]: the rdma_cm layer (ids, files, events) over the CM agent; pure.
//! - [`mcast`]: the VM's IGMP memberships of the multicast groups its ids joined.
//! - [`neigh`]: the route and the neighbour of an address resolution (rtnetlink).
//! - [`signals`]: what a signal to a thread blocked in GET_EVENT asks for (a restart,
//!   or EINTR when it is fatal).
//! - [`lanes`]: each file's requests in arrival order, one at a time, under several
//!   service threads.
//! - [`closing`]: what the callers' files answer after the service stops, until they
//!   are closed.
//! - [`keeper`]: a second process holding the device, which answers the callers' files
//!   when the service is killed outright.
//! - [`server`]: the threads joining CUSE, the rdma_cm layer and the pvcm device.
//! - [`client`]: the other end: a client of the rdma_cm device, as librdmacm writes to
//!   it (`pvcm-guest` runs its commands through it while the service owns the device).

pub mod abi;
pub mod caller;
pub mod cli;
pub mod client;
pub mod closing;
pub mod cma;
pub mod cuse;
pub mod keeper;
pub mod lanes;
pub mod mcast;
pub mod neigh;
pub mod netlink;
pub mod nldev;
pub mod server;
pub mod signals;
pub mod verbs;
