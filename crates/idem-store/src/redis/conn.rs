//! One connection type for a single server and a Cluster, and the Lua script calls sent on it.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{
    Cmd, ErrorKind, FromRedisValue, Pipeline, RedisFuture, RedisResult, Script, ServerErrorKind,
    ToRedisArgs, Value,
};

/// A connection to one Redis server or to a Cluster; both reconnect by themselves. The store's
/// own, and what other parts of idem that talk to Redis (the stream consumer) send on.
#[derive(Clone)]
pub enum Conn {
    /// One server.
    Single(ConnectionManager),
    /// A Cluster.
    Cluster(ClusterConnection),
}

impl Conn {
    /// Whether it reaches a Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Conn::Cluster(_))
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// A Lua script, called by its hash; see [`LuaCall`].
pub(crate) struct Lua(Script);

impl Lua {
    pub(crate) fn new(code: &str) -> Self {
        Self(Script::new(code))
    }

    /// A call whose first `keys` arguments are the keys it touches (`KEYS`), the rest its
    /// `ARGV`.
    pub(crate) fn call(&self, keys: usize) -> LuaCall<'_> {
        // One buffer for the whole command, sized for the usual call (a record's key, a few
        // numbers and a response of a few hundred bytes): built once, no copy when sent.
        let mut cmd = Cmd::with_capacity(8, 512);
        cmd.arg("EVALSHA").arg(self.0.get_hash()).arg(keys);
        LuaCall {
            lua: self,
            cmd,
            keys,
        }
    }

    /// A call on the one key `key`.
    pub(crate) fn key(&self, key: impl ToRedisArgs) -> LuaCall<'_> {
        let mut call = self.call(1);
        call.arg(key);
        call
    }
}

/// One call of a [`Lua`] script, written straight into its `EVALSHA` command.
///
/// redis-rs's `ScriptInvocation` keeps every key and argument in a vector of its own and
/// copies them all into a new command when it is sent: half a dozen allocations and a copy of
/// the response on every record written, on the path every message and request takes. This
/// does what it does (`EVALSHA`; on `NOSCRIPT`, `SCRIPT LOAD` and once more) on one buffer.
pub(crate) struct LuaCall<'a> {
    lua: &'a Lua,
    cmd: Cmd,
    /// How many of the arguments after the first three are keys.
    keys: usize,
}

impl LuaCall<'_> {
    /// Adds the next argument (keys first: as many as the call was made with).
    pub(crate) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// Runs the script, loading it first if the server does not have it (a restarted or
    /// failed-over server, a flushed script cache).
    pub(crate) async fn invoke_async<T: FromRedisValue>(&self, conn: &mut Conn) -> RedisResult<T> {
        debug_assert!(
            self.cmd.args_iter().count() >= 3 + self.keys,
            "a script call was given fewer arguments than it has keys"
        );
        match self.cmd.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.lua.0.load_async(conn).await?;
                self.cmd.query_async(conn).await
            }
            answer => answer,
        }
    }
}
