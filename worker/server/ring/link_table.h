// The link table: where this worker's ring goes. One outgoing Frames stream per peer address (a link, shared by
// every session going there; link.h), the broken ones until gRPC is done with them, and one unary channel per
// peer address (OpenSession and CloseSession along the route).
//
// A part that owns its containers and its lock. A link is made outside the lock (making one starts a gRPC call)
// and kept only if no other thread kept one for that address first; the loser is handed back, to be told to end
// and buried with the broken ones (`bury`) rather than waited for: its maker may be a gRPC callback.
// `prune` asks each link whether it is idle or done, so `LinkTable::mu_` is taken before `Link::mu_` and never
// under it (a link tells the worker it broke with its own lock released; docs/worker.md "Locks and their order").
// Every link and channel is handed out as a shared pointer and closed or destroyed by whoever takes the last
// one out, outside this lock.
//
// What a link is (gRPC's reactor) is the worker's: the table is a template over it (and over the channel),
// as the session table is over sessions, so link_table_test.cpp tests it with nothing of gRPC.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace dgr {

// L: `bool idle()` (no session sent there is open, nothing queued or in flight) and `bool done()` (gRPC is
// finished with it). C: any channel.
template <class L, class C>
class LinkTable {
  public:
    using LinkPtr = std::shared_ptr<L>;
    using ChannelPtr = std::shared_ptr<C>;

    LinkTable() = default;
    LinkTable(const LinkTable &) = delete;
    LinkTable & operator=(const LinkTable &) = delete;

    // The link to `address`: the one kept, else one `make()` makes (outside the lock). nullptr once stopped.
    // `lost`: a link made here that another thread's beat into the table, or made while the table stopped (the
    // caller ends it without waiting and buries it).
    // (A template, not std::function: a frame's send asks this, and nothing is allocated when the link is kept.)
    template <class Make>
    LinkPtr open(const std::string & address, Make && make, LinkPtr * lost) {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (stopped_) return nullptr;
            if (auto it = live_.find(address); it != live_.end()) return it->second;
        }
        LinkPtr made = make();
        std::lock_guard<std::mutex> g(mu_);
        if (stopped_) {
            *lost = std::move(made);
            return nullptr;
        }
        auto [it, fresh] = live_.emplace(address, made);
        if (!fresh) *lost = std::move(made);
        return it->second;
    }

    // The link kept for `address` (nullptr: none).
    LinkPtr find(const std::string & address) const {
        std::lock_guard<std::mutex> g(mu_);
        auto it = live_.find(address);
        return it == live_.end() ? nullptr : it->second;
    }

    // A link made for `open` that lost the race, already told to end (Link::abandon): kept with the broken ones
    // until gRPC is done with it (prune), so its maker, which may be one of gRPC's threads, never waits for it.
    void bury(LinkPtr link) {
        std::lock_guard<std::mutex> g(mu_);
        dead_.push_back(std::move(link));
    }

    // `link` broke: never handed out again (the next frame to its address opens a new one); kept until done.
    // Only the link kept for the address is retired (a newer one replaced an older one already).
    void retire(const std::string & address, const L * link) {
        std::lock_guard<std::mutex> g(mu_);
        auto it = live_.find(address);
        if (it == live_.end() || it->second.get() != link) return;
        dead_.push_back(std::move(it->second));
        live_.erase(it);
    }

    // Every link kept, broken ones left out.
    std::vector<LinkPtr> live() const {
        std::lock_guard<std::mutex> g(mu_);
        std::vector<LinkPtr> out;
        out.reserve(live_.size());
        for (auto & kv : live_) out.push_back(kv.second);
        return out;
    }

    // The unary channel to `address`, made by `make()` the first time (under the lock: a channel starts no call).
    template <class Make>
    ChannelPtr channel(const std::string & address, Make && make) {
        std::lock_guard<std::mutex> g(mu_);
        auto & c = channels_[address];
        if (!c) c = make();
        return c;
    }

    // What no open session goes to any more: the channels and the idle links to addresses not in `used`, and
    // the broken links gRPC is done with. Taken out of the table and handed back (the caller closes the links
    // and lets go of both outside every lock), so a member naming ever new addresses cannot grow the worker.
    struct Pruned {
        std::vector<LinkPtr> links;
        std::vector<ChannelPtr> channels;
    };
    Pruned prune(const std::set<std::string> & used) {
        std::lock_guard<std::mutex> g(mu_);
        Pruned out;
        for (auto it = channels_.begin(); it != channels_.end();) {
            if (used.count(it->first)) { ++it; continue; }
            out.channels.push_back(std::move(it->second));
            it = channels_.erase(it);
        }
        for (auto it = live_.begin(); it != live_.end();) {
            if (used.count(it->first) || !it->second->idle()) { ++it; continue; }
            out.links.push_back(std::move(it->second));
            it = live_.erase(it);
        }
        for (auto it = dead_.begin(); it != dead_.end();) {
            if (!(*it)->done()) { ++it; continue; }
            out.links.push_back(std::move(*it));
            it = dead_.erase(it);
        }
        return out;
    }

    // Stopping: no link is opened from now on; every link kept, broken ones included (the caller closes them).
    std::vector<LinkPtr> stop() {
        std::lock_guard<std::mutex> g(mu_);
        stopped_ = true;
        std::vector<LinkPtr> out;
        for (auto & kv : live_) out.push_back(kv.second);
        out.insert(out.end(), dead_.begin(), dead_.end());
        return out;
    }

    // Stopped and closed: every link and channel taken out (to be destroyed outside the lock).
    Pruned clear() {
        std::lock_guard<std::mutex> g(mu_);
        Pruned out;
        for (auto & kv : live_) out.links.push_back(std::move(kv.second));
        out.links.insert(out.links.end(), dead_.begin(), dead_.end());
        for (auto & kv : channels_) out.channels.push_back(std::move(kv.second));
        live_.clear();
        dead_.clear();
        channels_.clear();
        return out;
    }

    // Links (kept and broken) and channels held: the worker's dgr_worker_links gauge.
    size_t size() const {
        std::lock_guard<std::mutex> g(mu_);
        return live_.size() + dead_.size() + channels_.size();
    }

  private:
    mutable std::mutex mu_;
    std::map<std::string, LinkPtr> live_;            // one Frames stream per peer address
    std::vector<LinkPtr> dead_;                      // broken ones, until gRPC is done with them
    std::map<std::string, ChannelPtr> channels_;     // unary calls (open and close chains)
    bool stopped_ = false;
};

}  // namespace dgr
