//! TopoLVM's LVService and VGService (served by [`super::server`]). Requests that change or read the records run
//! one at a time on a blocking thread (they wait on the daemon and on fsync);
//! Watch streams from a task that looks at the pools every second and sends
//! when anything it reports has changed, and at once after every change.

use super::pb::lv_service_server::LvService;
use super::pb::vg_service_server::VgService;
use super::pb::{self};
use super::{Error, Lvmd, VolumeInfo};
use crate::sync::Unpoison;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Watch streams open at once, at most (TopoLVM's node plugin opens one).
const MAX_WATCHES: usize = 64;

pub(super) fn status(e: Error) -> Status {
    match e {
        Error::NotFound(m) => Status::not_found(m),
        Error::Exhausted(m) => Status::resource_exhausted(m),
        Error::Invalid(m) => Status::invalid_argument(m),
        Error::Exists(m) => Status::already_exists(m),
        Error::OutOfRange(m) => Status::out_of_range(m),
        Error::Unimplemented(m) => Status::unimplemented(m),
        Error::InUse(m) => Status::failed_precondition(m),
        Error::Internal(m) => Status::internal(m),
    }
}

fn lv(v: VolumeInfo) -> pb::LogicalVolume {
    pb::LogicalVolume {
        name: v.name,
        dev_major: v.major,
        dev_minor: v.minor,
        tags: v.tags,
        size_bytes: v.size_bytes.min(i64::MAX as u64) as i64,
        path: v.path,
        attr: v.attr,
    }
}

#[derive(Clone)]
pub(super) struct Shared {
    pub lvmd: Arc<Mutex<Lvmd>>,
    /// Bumped after every change: Watch streams send then.
    changed: Arc<watch::Sender<u64>>,
}

impl Shared {
    pub fn new(lvmd: Lvmd) -> Shared {
        let (changed, _) = watch::channel(0u64);
        Shared {
            lvmd: Arc::new(Mutex::new(lvmd)),
            changed: Arc::new(changed),
        }
    }

    /// Run F on the records on a blocking thread.
    pub async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Lvmd) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Status> {
        let l = self.lvmd.clone();
        tokio::task::spawn_blocking(move || f(&mut l.lock().unpoisoned()))
            .await
            .map_err(|e| Status::internal(format!("lvmd: a request's thread failed: {e}")))?
            .map_err(status)
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n += 1);
    }
}

#[tonic::async_trait]
impl LvService for Shared {
    async fn create_lv(
        &self,
        r: Request<pb::CreateLvRequest>,
    ) -> Result<Response<pb::CreateLvResponse>, Status> {
        let r = r.into_inner();
        let v = self
            .with(move |l| l.create_lv(&r.name, &r.device_class, r.size_bytes, r.tags))
            .await?;
        self.notify();
        Ok(Response::new(pb::CreateLvResponse { volume: Some(lv(v)) }))
    }

    async fn remove_lv(&self, r: Request<pb::RemoveLvRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.with(move |l| l.remove_lv(&r.name, &r.device_class)).await?;
        self.notify();
        Ok(Response::new(pb::Empty {}))
    }

    async fn resize_lv(
        &self,
        r: Request<pb::ResizeLvRequest>,
    ) -> Result<Response<pb::ResizeLvResponse>, Status> {
        let r = r.into_inner();
        let size = self
            .with(move |l| l.resize_lv(&r.name, &r.device_class, r.size_bytes))
            .await?;
        self.notify();
        Ok(Response::new(pb::ResizeLvResponse {
            size_bytes: size.min(i64::MAX as u64) as i64,
        }))
    }

    async fn create_lv_snapshot(
        &self,
        r: Request<pb::CreateLvSnapshotRequest>,
    ) -> Result<Response<pb::CreateLvSnapshotResponse>, Status> {
        let r = r.into_inner();
        let v = self
            .with(move |l| {
                l.create_snapshot(
                    &r.name,
                    &r.device_class,
                    &r.source_volume,
                    r.size_bytes,
                    &r.access_type,
                    r.tags,
                )
            })
            .await?;
        self.notify();
        Ok(Response::new(pb::CreateLvSnapshotResponse {
            snapshot: Some(lv(v)),
        }))
    }
}

/// What Watch sends, from the pools as they are now.
fn watch_response(l: &Lvmd) -> Result<pb::WatchResponse, Error> {
    let mut res = pb::WatchResponse::default();
    for c in l.usage()? {
        if c.default {
            res.free_bytes = c.overprovision_free;
        }
        let p = c.pool;
        res.items.push(pb::WatchItem {
            // no volume group: the pool's unused data space and its size
            free_bytes: p
                .data_blocks
                .saturating_sub(p.used_data_blocks)
                .saturating_mul(p.block_bytes),
            device_class: c.name,
            size_bytes: p.size_bytes(),
            thin_pool: Some(pb::ThinPoolItem {
                data_percent: p.data_percent(),
                metadata_percent: p.metadata_percent(),
                overprovision_bytes: c.overprovision_free,
                size_bytes: p.size_bytes(),
            }),
        });
    }
    Ok(res)
}

#[tonic::async_trait]
impl VgService for Shared {
    async fn get_lv_list(
        &self,
        r: Request<pb::GetLvListRequest>,
    ) -> Result<Response<pb::GetLvListResponse>, Status> {
        let r = r.into_inner();
        let vols = self.with(move |l| l.list(&r.device_class)).await?;
        Ok(Response::new(pb::GetLvListResponse {
            volumes: vols.into_iter().map(lv).collect(),
        }))
    }

    async fn get_free_bytes(
        &self,
        r: Request<pb::GetFreeBytesRequest>,
    ) -> Result<Response<pb::GetFreeBytesResponse>, Status> {
        let r = r.into_inner();
        let free = self.with(move |l| l.free_bytes(&r.device_class)).await?;
        Ok(Response::new(pb::GetFreeBytesResponse { free_bytes: free }))
    }

    type WatchStream = ReceiverStream<Result<pb::WatchResponse, Status>>;

    async fn watch(&self, _r: Request<pb::Empty>) -> Result<Response<Self::WatchStream>, Status> {
        // each stream looks at the pools every second: a bound on them keeps
        // a client that opens thousands from starving every other request
        if self.changed.receiver_count() >= MAX_WATCHES {
            return Err(Status::resource_exhausted(format!(
                "{MAX_WATCHES} Watch streams are open already"
            )));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let me = self.clone();
        let mut changed = self.changed.subscribe();
        tokio::spawn(async move {
            let mut last: Option<pb::WatchResponse> = None;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                let now = me.with(|l| watch_response(l)).await;
                let send = match (&now, &last) {
                    (Ok(n), Some(l)) => n != l,
                    _ => true,
                };
                if send {
                    let stop = now.is_err();
                    if tx.send(now.clone()).await.is_err() || stop {
                        return;
                    }
                    last = now.ok();
                }
                tokio::select! {
                    _ = tick.tick() => {}
                    r = changed.changed() => if r.is_err() { return },
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
