//! Bodies: a guarded request's, read whole within its limit, and the response bodies the layer
//! hands back.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http::header::CONTENT_LENGTH;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};

use crate::problem::Problem;
use crate::problem::ToProblem;
use idem_wire::ProblemCode;

/// A boxed error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response the layer returns: the handler's own, a stored one, or a problem.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// Boxes any body into a [`ResponseBody`].
pub fn boxed<B>(body: B) -> ResponseBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// Reads a guarded request's body, refusing one over `max` before reading it if its length
/// is declared.
pub(crate) async fn read_body<B>(headers: &HeaderMap, body: B, max: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large(max));
    }
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(too_large(max)),
        Err(_) => Err(ProblemCode::RequestBodyUnreadable
            .problem("The request body could not be read to its end.")),
    }
}

fn too_large(max: usize) -> Problem {
    ProblemCode::BodyTooLarge
        .problem(format!(
            "The request body exceeds the limit of {max} bytes."
        ))
        .with("max_body", max)
}

/// A body whose first bytes were already read: yields them, then the rest.
pub(crate) struct Prefixed {
    prefix: Option<Bytes>,
    rest: ResponseBody,
}

impl Prefixed {
    pub(crate) fn new(prefix: Bytes, rest: ResponseBody) -> Self {
        Self {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest,
        }
    }
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let extra = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(extra));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(extra));
        }
        hint
    }
}

/// The outcome of reading a body with a limit.
pub(crate) enum Collected {
    /// The whole body, within the limit, and its trailers (empty if it had none).
    Full(Bytes, HeaderMap),
    /// The limit was passed: what was read, and the unread rest.
    TooLarge(Bytes, ResponseBody),
    /// The body failed part way.
    Failed,
}

/// Reads `body` up to `limit` bytes, and its trailers.
pub(crate) async fn collect_limited(mut body: ResponseBody, limit: usize) -> Collected {
    let mut buf = bytes::BytesMut::new();
    let mut trailers = HeaderMap::new();
    loop {
        match body.frame().await {
            None => return Collected::Full(buf.freeze(), trailers),
            Some(Err(_)) => return Collected::Failed,
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return Collected::TooLarge(buf.freeze(), body);
                    }
                }
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        trailers.extend(more);
                    }
                }
            },
        }
    }
}

/// A whole body, then its trailers if it has any.
pub(crate) fn full_with_trailers(body: Bytes, trailers: HeaderMap) -> ResponseBody {
    let full = Full::new(body);
    if trailers.is_empty() {
        return boxed(full);
    }
    boxed(full.with_trailers(std::future::ready(Some(Ok(trailers)))))
}
